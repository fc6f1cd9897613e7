"""custom_kernel and the decoder object: validation, per-cache state, backends.

Backends:
- "kernels": the projection stages of mla_decode.projections (on Hopper our
  GEMM for the down stage and one fused launch for the query, its RoPE and
  the cache append; elsewhere vendor GEMMs writing where the next stage
  reads and the RoPE + cache-append kernel),
  the split-KV attention kernel reading a rotated copy of the cache's rope
  columns, with LSE combine; from the second call on a (cache, dims, weight
  addresses) key the whole step is a replayed CUDA/HIP graph.
- "torch": the absorbed form in plain PyTorch (W_UK folded into the query,
  W_UV applied after attention), used wherever the kernels are not built or
  not usable (the CPU included).
The backend of every call is recorded in ``MLADecoder.last_backend``;
``mla_decode.backend()`` says which one a device gets and why.
"""

from __future__ import annotations

import collections
import math
import operator
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from ._ext import backend as _backend_text
from ._ext import kernels_usable
from ._ext import module as _ext_module
from .attention import mla_attention, rope_table, splits_possible
from . import projections
from .reference import rope_rotate

__all__ = ["MLADecoder", "MLAInputError", "custom_kernel", "Dims"]

_WEIGHTS = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")


class MLAInputError(ValueError):
    """A call's inputs do not fit the layer; nothing was written."""


@dataclass(frozen=True)
class Dims:
    bs: int
    dim: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    max_seq_len: int


def _shape(t):
    return list(t.shape)


def _check_tensor(name, t, shape, device, shape_text):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise MLAInputError(f"{name} must be on {device} (where x is), got {t.device}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise MLAInputError(f"{name} must have shape {shape_text} = {list(shape)}, got {_shape(t)}")
    if t.numel() and t.stride(-1) != 1:
        raise MLAInputError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def validate(config, x, kv_cache, weights_known=None) -> Dims:
    """Check a call's inputs (device, dtype, layout, shape, capacity) and
    return its dims. Raises MLAInputError/TypeError naming what was expected.
    ``weights_known(config, dims)``, when given and true, vouches for the
    five weights (MLADecoder passes its _WeightStamp.matches, which compares
    address, shape, strides, dtype and device with a set that passed these
    checks: all that the checks read), so they are not checked again."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    try:
        H, q_lora, kv_lora = int(config.n_heads), int(config.q_lora_rank), int(config.kv_lora_rank)
        nope, rope, v, dim = (int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                              int(config.v_head_dim), int(config.dim))
    except AttributeError as e:
        raise MLAInputError(f"config is missing a field: {e}") from None
    if min(H, q_lora, kv_lora, nope, v, dim) <= 0 or rope <= 0 or rope % 2:
        raise MLAInputError(f"config dims must be positive and qk_rope_head_dim even, got n_heads={H}, "
                            f"q_lora_rank={q_lora}, kv_lora_rank={kv_lora}, nope={nope}, rope={rope}, v={v}, dim={dim}")
    dev = x.device
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be torch.bfloat16, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != dim or x.shape[0] < 1:
        raise MLAInputError(f"x must have shape [bs, 1, {dim}], got {_shape(x)}")
    if not x.is_contiguous():
        raise MLAInputError(f"x must be contiguous, got strides {x.stride()}")
    bs = x.shape[0]
    data = getattr(kv_cache, "data", None)
    if not isinstance(data, torch.Tensor):
        raise TypeError("kv_cache.data must be a torch.Tensor")
    if data.dim() != 3:
        raise MLAInputError(f"kv_cache.data must have shape [bs, max_seq_len, {kv_lora + rope}], got {_shape(data)}")
    dims = Dims(bs, dim, H, q_lora, kv_lora, nope, rope, v, data.shape[1])
    if weights_known is None or not weights_known(config, dims, dev):
        _check_weights(config, dims, dev)
    _check_tensor("kv_cache.data", data, (bs, data.shape[1], kv_lora + rope), dev,
                  f"[bs={bs}, max_seq_len, kv_lora_rank + rope = {kv_lora + rope}]")
    seq_len = kv_cache.seq_len
    if not isinstance(seq_len, int) or seq_len < 0:
        raise MLAInputError(f"kv_cache.seq_len must be a non-negative int, got {seq_len!r}")
    if seq_len >= data.shape[1]:
        raise MLAInputError(f"kv_cache is full: seq_len {seq_len} == max_seq_len {data.shape[1]}; "
                            "nothing was written")
    return dims


def _weight_shapes(d: Dims):
    return {
        "Q_proj_down_weight": ((d.q_lora, d.dim), "[q_lora_rank, dim]"),
        "KV_proj_down_weight": ((d.kv_lora + d.rope, d.dim), "[kv_lora_rank + rope, dim]"),
        "Q_proj_up_weight": ((d.heads * (d.nope + d.rope), d.q_lora), "[n_heads * (nope + rope), q_lora_rank]"),
        "KV_proj_up_weight": ((d.heads * (d.nope + d.v), d.kv_lora), "[n_heads * (nope + v), kv_lora_rank]"),
        "wo_weight": ((d.dim, d.heads * d.v), "[dim, n_heads * v]"),
    }


def _check_weights(config, dims: Dims, dev):
    for name, (shape, text) in _weight_shapes(dims).items():
        if not hasattr(config, name):
            raise MLAInputError(f"config is missing {name}")
        t = getattr(config, name)
        _check_tensor(f"config.{name}", t, shape, dev, text)
        if not t.is_contiguous():
            raise MLAInputError(f"config.{name} must be contiguous, got strides {t.stride()}")


class _WeightStamp:
    """The layouts (address, shape, strides, dtype, device) of the five
    weights of the last call that passed validation. The weight checks read
    nothing else, so weights with the same layouts (the same objects, or new
    ones over the same memory, whatever their values) pass them again and
    validate() is spared re-checking them. Nothing is derived from the
    weights' values and kept: every call reads the weights where they lie.
    (Python, not the C++ LayoutStamp that _LastCall uses: the full path
    also serves the PyTorch fallback, where the extension may be missing.)"""

    def __init__(self, config, dims: Dims):
        self.layouts = tuple(_weight_layout(getattr(config, n)) for n in _WEIGHTS)
        self.wdims = _weight_dims(dims)

    def weights_match(self, config) -> bool:
        for name, layout in zip(_WEIGHTS, self.layouts):
            w = getattr(config, name, None)
            if not isinstance(w, torch.Tensor) or _weight_layout(w) != layout:
                return False
        return True

    def matches(self, config, dims: Dims, device=None) -> bool:
        return (_weight_dims(dims) == self.wdims and self.weights_match(config)
                and (device is None or self.layouts[0][4] == device))


def _weight_dims(d: Dims):
    return (d.dim, d.heads, d.q_lora, d.kv_lora, d.nope, d.rope, d.v)


def _weight_layout(w):
    return (w.data_ptr(), w.shape, w.stride(), w.dtype, w.device)


_CONFIG_DIMS = ("n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "dim")
_dims_of = operator.attrgetter(*_CONFIG_DIMS)
_weights_of = operator.attrgetter(*_WEIGHTS)


class _LastCall:
    """The last graphed call: its inputs as validate() passed them (the
    config's dims as given; the cache tensor by weak reference; the layouts
    of x, the cache and the five weights, in a C++ LayoutStamp: shape,
    strides, dtype, device, and the address of the cache and the weights)
    and what was derived from them (dims, rope tables, cache state, captured
    step). A call whose inputs compare equal on all of these would pass the
    same checks and derive the same things, so MLADecoder replays the step
    at once. The weights' identity and values do not enter: the checks read
    only their layout, and the graph reads them where they lie (so new
    weight objects at the same addresses, as the task's ranked mode passes
    them, take this path too). Anything else, including every input error,
    takes the full path."""

    __slots__ = ("cfg_dims", "data", "layouts", "dims", "tables", "st", "step")

    def __init__(self, config, x, data, dims, tables, st, step):
        self.cfg_dims = _dims_of(config)
        self.data = weakref.ref(data)
        self.layouts = _ext_module().LayoutStamp([x, data, *_weights_of(config)], [False] + [True] * 6)
        self.dims, self.tables, self.st, self.step = dims, tables, st, step

    def matches(self, config, x, data) -> bool:
        if data is None or self.data() is not data:
            return False
        try:
            if _dims_of(config) != self.cfg_dims:
                return False
            return self.layouts.matches([x, data, *_weights_of(config)])
        except (AttributeError, TypeError):  # a field missing, or not a tensor: the full path says which
            return False


_MAX_CACHES = 4
_MAX_GRAPHS = 4


class _CacheState:
    """What the decoder keeps for one cache tensor: a rotated copy of its
    k_pe columns, [bs, max_seq_len, rope] (rows [0, valid) hold rot(k_pe) at
    their own position, exactly as the kernel would rotate them on the fly,
    so the attention runs without rotating).

    The copy is trusted only for the same tensor object at the version
    counter seen after the decoder's last step on it: any write through
    PyTorch (a view's too) bumps the counter and the copy is rebuilt from the
    cache. A write that bypasses PyTorch (a raw pointer, DLPack) must be
    followed by MLADecoder.forget_caches()."""

    def __init__(self, data, dims: Dims):
        self.ref = weakref.ref(data)
        self.kpe = torch.empty(dims.bs, dims.max_seq_len, dims.rope, dtype=torch.bfloat16, device=data.device)
        self.valid = 0
        self.version = None
        self.key = None  # set by MLADecoder._cache_state
        # the Hopper attention's table of length-bounded TMA maps for this
        # cache and kpe (a last, partial key half by TMA: measured on an H200,
        # cp.async there cost ~3-4.5 us per call at every task prefill); kept
        # here, so alive with the graphs that hold this state
        self.bmaps = None
        self.bounded_done = False

    def register_bounded(self, data, r):
        """Register this cache's and kpe's layout for the Hopper attention
        (once, outside a capture; the full path calls it, and every graphed
        call went through the full path first)."""
        if not self.bounded_done and not torch.cuda.is_current_stream_capturing():
            self.bounded_done = True
            self.bmaps = _ext_module().attention_bounded_register(data, self.kpe, r)

    def ready(self, data, n, tables, r):
        """Make rows [0, n) of the rotated copy current."""
        if self.ref() is not data or data._version != self.version:
            self.valid = 0
        if self.valid < n:
            lo = self.valid
            self.kpe[:, lo:n] = rope_rotate(data[:, lo:n, r:], tables[1][lo:n], tables[2][lo:n])
            self.valid = n

    def stepped(self, data, L):
        """After a step that wrote row L - 1 into the cache and the copy."""
        self.valid = L
        self.version = data._version


class _GraphStep:
    """One captured step: static x, seqlens, y and split-plan buffers around
    a graph of MLADecoder._core. A call copies x in, replays, and returns a
    copy of y as [bs, 1, dim] (the caller owns it; the next replay cannot
    touch it). Right after its attention the graph advances seqlens by one
    and plans the attention's split for those lengths into the plan buffer,
    beside the output projections, so consecutive steps on one cache need no
    host write and no planner ahead of the attention (measured: the planner
    in the step's path cost its graph 11-15 us at prefill 512 and 2048). Any
    other length is written, and planned, before the replay. Calls on one
    cache must be ordered on one stream, as eager calls must. Where PyTorch
    gives the instantiated graph (CUDAGraph.raw_cuda_graph_exec), the copies,
    the planning of a rewritten length and the launch are one C++ call
    (mla_decode._C.StepLauncher); the graph holds no random-number kernels,
    so PyTorch's per-replay generator bookkeeping has nothing to do. When
    two consecutive calls pass x at one address, the step is captured a
    second time reading x there (direct_wanted / capture_direct; same
    buffers and memory pool), and calls with x at that address launch it
    with no copy in."""

    def __init__(self, run, dims, device, split=True):
        self.x = torch.zeros(dims.bs, dims.dim, dtype=torch.bfloat16, device=device)
        self.seqlens = torch.ones(dims.bs, dtype=torch.int32, device=device)
        self.y = torch.empty(dims.bs, dims.dim, dtype=torch.bfloat16, device=device)
        self.y_shape = (dims.bs, 1, dims.dim)
        self.plan_args = (1, dims.heads, dims.max_seq_len, split)  # s_q, h_q, capacity, split (see _core)
        self.plan = self._make_plan()
        self.next_len = None  # what seqlens holds after the last replay (Python path)
        self._side = torch.cuda.Stream(device=device)
        self.graph = self._capture(run, self.x)
        raw = getattr(self.graph, "raw_cuda_graph_exec", None)
        self.launcher = (_ext_module().StepLauncher(raw(), self.x, self.y, self.seqlens, list(self.y_shape),
                                                    self.plan, *self.plan_args)
                         if raw is not None else None)
        # the step captured on a caller's x where it lies (see direct_wanted)
        self.direct = None
        self.direct_done = self.launcher is None  # (one try per step; none without the C++ launcher)
        self._last_x = 0

    def _capture(self, run, x2, pool=None):
        """A graph of run() reading x2, writing self.y, reading and advancing
        self.seqlens and self.plan."""
        graph = torch.cuda.CUDAGraph()
        side = self._side

        def after_attention():  # the next step's lengths and plan, beside the output projections
            side.wait_stream(torch.cuda.current_stream())  # (after the attention, the last reader of seqlens)
            with torch.cuda.stream(side):
                self.seqlens.add_(1)
                self.plan.copy_(self._make_plan())

        with torch.cuda.graph(graph, pool=pool):
            run(x2, self.seqlens, self.y, self.plan, after_attention)
            torch.cuda.current_stream().wait_stream(side)
        return graph

    def direct_wanted(self, x):
        """True once when two consecutive launches passed x at one address
        (as a decode loop over one input buffer, or the task's harness,
        does): the caller then captures the step on that x (capture_direct),
        so that launches with x there need no copy in (measured on an H200:
        ~8 us of wall clock per call). One try per step."""
        if self.direct_done:
            return False
        p = x.data_ptr()
        if p != self._last_x:
            self._last_x = p
            return False
        self.direct_done = True
        return True

    def capture_direct(self, run, x):
        """Capture run() reading x where it lies (in this step's memory pool:
        the two graphs never run at once) and register it with the launcher.
        The graph holds x's address, not x: a later call passing another
        tensor there, of x's layout, is read where it lies, as it should be."""
        try:
            graph = self._capture(run, x.view(self.x.shape), pool=self.graph.pool())
            self.launcher.set_direct(graph.raw_cuda_graph_exec(), x)
        except Exception as e:  # noqa: BLE001 - said once, loudly; the step keeps copying x in
            warnings.warn(f"mla_decode: capture of the step on the caller's x failed, x is copied in as before: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)
            return
        self.direct = graph

    def _make_plan(self):
        return torch.ops.mla_decode.plan(self.seqlens, *self.plan_args)

    def __call__(self, x, L):
        if self.launcher is not None:
            y = self.launcher.launch(x, L)
            if y is None:
                raise RuntimeError("mla_decode: a captured step cannot run while the stream is capturing")
            return y
        copy = _ext_module().copy_async
        copy(self.x, x)
        if L != self.next_len:
            self.next_len = None
            self.seqlens.fill_(L)
            self.plan.copy_(self._make_plan())
        self.graph.replay()
        self.next_len = L + 1
        y = torch.empty(self.y_shape, dtype=self.y.dtype, device=self.y.device)
        copy(y, self.y)
        return y


class MLADecoder:
    """One MLA decode layer. Call it as ``decoder(config, x, kv_cache)`` or
    ``decoder.step(data)``; it appends the new latent row to
    ``kv_cache.data`` in place, advances ``kv_cache.seq_len`` and returns
    ``(y [bs, 1, dim] bf16, kv_cache.data)``.

    backend: "auto" (kernels where usable, else the PyTorch fallback, with a
    warning when a GPU call falls back), "kernels" (raise if not usable) or
    "torch". graphs: capture and replay the step (kernels backend; see the
    README's contract for what a capture serves and what it keeps).
    last_backend / last_graphed say how the last call ran. After writing a
    cache other than through PyTorch, call forget_caches()."""

    def __init__(self, backend: str = "auto", graphs: bool = True):
        if backend not in ("auto", "kernels", "torch"):
            raise ValueError(f"backend must be 'auto', 'kernels' or 'torch', got {backend!r}")
        self.backend = backend
        self.graphs = bool(graphs)
        self.last_backend = None
        self.last_graphed = False
        self._lock = threading.Lock()
        self._caches = collections.OrderedDict()  # cache key -> _CacheState, oldest first
        self._graphs = collections.OrderedDict()  # (cache key, dims, weight addresses) -> _GraphStep
        self._seen = collections.OrderedDict()    # keys seen once (the next call with one captures)
        self._failed = set()
        self._stamp = None
        self._last = None  # _LastCall of the last graphed call
        self._rope = {}
        self._warned = set()
        self._chosen = {}
        self._splits = {}

    # -- derived state ------------------------------------------------------
    def _stamp_weights(self, config, dims):
        self._stamp = _WeightStamp(config, dims)

    def _rope_tables(self, device, rope, positions):
        """(table [n, rope] = cos | sin of the rope/2 frequencies, as the kernels
        take it; cos2, sin2 [n, rope] laid out [a, a], as rope_rotate takes them)."""
        key = (device, rope, positions)
        with self._lock:
            t = self._rope.get(key)
            if t is None:
                table = rope_table(positions, rope, device)
                half = rope // 2
                cos2 = torch.cat([table[:, :half], table[:, :half]], dim=-1)
                sin2 = torch.cat([table[:, half:], table[:, half:]], dim=-1)
                t = (table, cos2, sin2)
                self._rope[key] = t
            return t

    def _choose(self, dims, device):
        key = (dims.kv_lora, dims.rope, device)
        which = self._chosen.get(key)
        if which is None:
            which = self._chosen[key] = self._choose_uncached(dims, device)
        return which

    def _choose_uncached(self, dims, device):
        if self.backend == "torch":
            return "torch"
        supported = dims.kv_lora == 512 and dims.rope == 64
        usable = kernels_usable(device)
        if usable and supported:
            return "kernels"
        why = (f"kv_lora_rank={dims.kv_lora}, rope={dims.rope} (the kernels take 512 and 64)"
               if usable else _backend_text(device))
        if self.backend == "kernels":
            raise RuntimeError(f"backend='kernels' requested but not usable: {why}")
        if device.type == "cuda" and why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"mla_decode: using the PyTorch fallback on {device}: {why}", RuntimeWarning, stacklevel=3)
        return "torch"

    # -- the step -----------------------------------------------------------
    def __call__(self, config, x, kv_cache):
        last = self._last
        if last is not None:
            out = self._replay_last(last, config, x, kv_cache)
            if out is not None:
                return out
        known = self._stamp
        vouched = []

        def vouch(config, dims, device):  # the last call's weight layouts: no need to check them again
            ok = known is not None and known.matches(config, dims, device)
            vouched.append(ok)
            return ok

        dims = validate(config, x, kv_cache, vouch)
        if not (vouched and vouched[0]):
            self._stamp_weights(config, dims)
        which = self._choose(dims, x.device)
        tables = self._rope_tables(x.device, dims.rope, dims.max_seq_len)
        data = kv_cache.data
        pos = kv_cache.seq_len  # the new row's position; L = pos + 1 after the append
        x2 = x.view(dims.bs, dims.dim)
        st = step = None
        if which == "kernels":
            st = self._cache_state(data, dims)
            st.register_bounded(data, dims.kv_lora)
            st.ready(data, pos, tables, dims.kv_lora)
            if self.graphs and not torch.cuda.is_current_stream_capturing():
                step = self._graph_step(st, config, dims, data, tables)
        if step is not None:
            y = step(x, pos + 1)
            self._maybe_direct(step, x, config, dims, data, tables, st)
            self.last_graphed = True
            self._last = _LastCall(config, x, data, dims, tables, st, step)
        else:
            self._last = None
            seqlens = torch.full((dims.bs,), pos + 1, dtype=torch.int32, device=x.device)
            y = torch.empty(dims.bs, dims.dim, dtype=torch.bfloat16, device=x.device)
            self._core(which, config, dims, x2, data, seqlens, y, tables, pos + 1,
                       kpe=st.kpe if st is not None else None)
            self.last_graphed = False
        if st is not None:
            st.stepped(data, pos + 1)
        kv_cache.seq_len = pos + 1
        self.last_backend = which
        return y.view(dims.bs, 1, dims.dim), data

    def _replay_last(self, last, config, x, kv_cache):
        """The step of the last graphed call, replayed, when this call's
        inputs match it (see _LastCall); else None (the full path)."""
        data = getattr(kv_cache, "data", None)
        pos = getattr(kv_cache, "seq_len", None)
        if not (isinstance(pos, int) and 0 <= pos < last.dims.max_seq_len):
            return None
        if not last.matches(config, x, data):
            return None
        dims, st, step = last.dims, last.st, last.step
        if step.launcher is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            st.ready(data, pos, last.tables, dims.kv_lora)
            y = step(x, pos + 1)
        else:
            st.ready(data, pos, last.tables, dims.kv_lora)  # what the full path would do first, capturing or not
            y = step.launcher.launch(x, pos + 1)
            if y is None:  # the stream is capturing: the full path runs the step eagerly into the capture
                return None
            self._maybe_direct(step, x, config, dims, data, last.tables, st)
        st.stepped(data, pos + 1)
        kv_cache.seq_len = pos + 1
        self.last_backend = "kernels"
        self.last_graphed = True
        return y, data

    def forget_caches(self):
        """Drop what the decoder keeps per cache (rotated keys, captured
        steps): call it after writing a cache other than through PyTorch."""
        self._last = None
        with self._lock:
            self._caches.clear()
            self._graphs.clear()
            self._seen.clear()

    def _cache_state(self, data, dims):
        key = (data.data_ptr(), tuple(data.shape), tuple(data.stride()), data.device)
        with self._lock:
            st = self._caches.get(key)
            if st is None or st.ref() is not data:
                for k in [k for k, v in self._caches.items() if v.ref() is None]:  # caches that died
                    del self._caches[k]
                st = self._caches[key] = _CacheState(data, dims)
                st.key = (key, id(st))  # unique while st lives (graphs hold their st)
                while len(self._caches) > _MAX_CACHES:
                    self._caches.popitem(last=False)
            self._caches.move_to_end(key)
            return st

    def _core(self, which, config, dims, x2, data, seqlens, y, tables, L=None, kpe=None, plan=None,
              after_attention=None):
        """One step on the device, with every position-dependent value read
        from ``seqlens`` (all = L) on the device, so that a captured graph of
        it serves every position. Writes the new cache row and ``y`` (and,
        with ``kpe``, the new row's rotated k_pe; the attention then reads
        the keys' rope columns from ``kpe`` instead of rotating them).
        ``plan``: the attention's split plan for these lengths (else it plans
        its own); ``after_attention()`` is called once the attention is
        enqueued (nothing after it reads seqlens or the plan)."""
        table, cos2, sin2 = tables
        bs, H, r, nope = dims.bs, dims.heads, dims.kv_lora, dims.nope
        wkv = config.KV_proj_up_weight.view(H, nope + dims.v, r)
        w_uk = wkv[:, :nope, :]                      # [H, nope, r]: q_nope -> latent
        w_uv_t = wkv[:, nope:, :].transpose(1, 2)    # [H, r, v]: latent -> value
        # 1-2. down-projections, on the weights where they lie
        q_lora, kv_new = projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)
        # 3-4. query: up-projection and W_UK absorption into the attention's layout,
        # then RoPE at the new row's position and the append of the new row
        qbuf = torch.empty(H, bs, r + dims.rope, dtype=torch.bfloat16, device=x2.device)
        q_att = projections.query_rope_append(q_lora, config.Q_proj_up_weight, w_uk, kv_new, seqlens, tables, qbuf,
                                              data, kernel=(which == "kernels"), kpe=kpe)
        scale = 1.0 / math.sqrt(dims.nope + dims.rope)
        # 5. attention over the latent cache (every sequence has the same
        # length: where the planner cannot split such a batch, no combine)
        if which == "kernels":
            split = self._split(dims, x2.device)
            if kpe is not None:
                o_lat, _ = mla_attention(q_att, data, seqlens, scale, kpe=kpe, plan=plan, split=split)
            else:
                o_lat, _ = mla_attention(q_att, data, seqlens, scale, rope_cs=table, plan=plan, split=split)
            o_lat = o_lat.view(bs, H, r)
        else:
            o_lat = _attention_torch(q_att[:, 0, :, :r], q_att[:, 0, :, r:], data[:, :L], cos2[:L], sin2[:L],
                                     dims, scale)
        if after_attention is not None:
            after_attention()
        # 6. W_UV per head, then wo
        obuf = torch.empty(bs, H, dims.v, dtype=torch.bfloat16, device=x2.device)
        projections.output(o_lat, w_uv_t, config.wo_weight, obuf, y)

    def _graph_step(self, st, config, dims, data, tables):
        """The captured step for this cache, dims and weight addresses, or
        None on the first call of a key (that call runs eagerly and warms up
        the libraries; the second captures). A graph reads the weights at the
        addresses it was captured with, so it serves any weight objects that
        lie there (new objects at the same addresses, in-place updates) and
        no other. At most _MAX_GRAPHS are kept, least recently used dropped."""
        key = (st.key, dims, tuple(getattr(config, n).data_ptr() for n in _WEIGHTS))
        with self._lock:
            entry = self._graphs.get(key)
            if entry is not None:
                self._graphs.move_to_end(key)
                return entry
            if key not in self._seen:
                self._seen[key] = True
                while len(self._seen) > 64:
                    self._seen.popitem(last=False)
                return None
            if key in self._failed:
                return None
        try:
            entry = _GraphStep(self._runner(config, dims, data, tables, st), dims, data.device,
                               self._split(dims, data.device))
        except Exception as e:  # noqa: BLE001 - said once, loudly; the call then runs eagerly
            with self._lock:
                self._failed.add(key)
            warnings.warn(f"mla_decode: CUDA/HIP graph capture of the step failed, running eagerly "
                          f"(slower host path): {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            return None
        entry.state = st  # the graph reads st.kpe: keep it alive with the graph
        with self._lock:
            self._graphs[key] = entry
            while len(self._graphs) > _MAX_GRAPHS:
                self._graphs.popitem(last=False)
        return entry

    def _split(self, dims, device):
        """Whether the step's attention may split sequences (attention.
        splits_possible for bs sequences of one length): False at the task's
        bs 128 on an H100/H200 (66 parts per head block), which then plans
        one part per sequence, as it would anyway, and launches no combine
        (measured on an H200 at prefill 512: attention end -> W_UV start
        3.1 -> 0.2 us in the profiled step; graph replay geomean -5 us)."""
        key = (device, dims.bs, dims.heads)
        split = self._splits.get(key)
        if split is None:
            split = self._splits[key] = splits_possible(dims.bs, 1, dims.heads, device)
        return split

    def _maybe_direct(self, step, x, config, dims, data, tables, st):
        """After a launch: capture the step on this x where it lies when the
        step asks for it (_GraphStep.direct_wanted), with this call's config."""
        if step.direct_wanted(x):
            step.capture_direct(self._runner(config, dims, data, tables, st), x)

    def _runner(self, config, dims, data, tables, st):
        """The step as a capture runs it: run(x2, seqlens, y, plan, after)."""
        return lambda x2, seqlens, y, plan, after: self._core("kernels", config, dims, x2, data, seqlens, y, tables,
                                                              kpe=st.kpe, plan=plan, after_attention=after)

    def step(self, data):
        config, x, kv_cache = data
        return self(config, x, kv_cache)


def _attention_torch(q_abs, q_pe, rows, cos, sin, dims: Dims, scale):
    """Absorbed attention in PyTorch: q_abs [bs, H, r], q_pe [bs, H, rope]
    (rotated), rows [bs, L, r + rope] un-rotated, cos/sin [L, rope] ([a, a]).
    Returns [bs, H, r] bf16."""
    c = rows[..., :dims.kv_lora]
    k_pe = rope_rotate(rows[..., dims.kv_lora:], cos, sin)                  # [bs, L, rope]
    scores = torch.bmm(q_abs, c.transpose(1, 2)).float() + torch.bmm(q_pe, k_pe.transpose(1, 2)).float()
    p = torch.softmax(scores * scale, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, c)


_DEFAULT = MLADecoder()


def custom_kernel(data):
    """The task's entry point: ``data = (config, x, kv_cache)``. Appends the
    new row to ``kv_cache.data`` in place, advances ``kv_cache.seq_len``,
    returns ``(y, kv_cache.data)``."""
    return _DEFAULT.step(data)

"""tools/plan_model.py, the CPU model of the split planner behind the docs'
span figures (docs/attention.md, "Lengths that differ"): its fixed-chunk cut
covers every sequence once, lists parts longest first and stays within the
plan's size; on bench_serving's batches its span is near the work per slot
where the equal parts' is 1.5x. (That the kernel cuts as the model does is
tests/test_gpu_attention.py::test_planner_cut_is_the_documented_one.)"""
import random

from conftest import load_plan_model

model = load_plan_model()


def batch(seed, b=128, mean=4096, tile=128):
    rnd = random.Random(seed)
    return [(max(int(rnd.normalvariate(mean, mean / 2)), 1) + tile - 1) // tile for _ in range(b)]


def test_fixed_chunks_cover_each_sequence_once_longest_part_first():
    for seed in range(5):
        tiles = batch(seed, b=60 + seed)
        tiles[0] = 0
        c, parts = model.fixed_chunks(tiles, 132, 132 + len(tiles))
        assert len(parts) <= 132 + len(tiles)
        sizes = [e - s for _, s, e, _, _ in parts]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) <= c
        for b, t in enumerate(tiles):
            mine = sorted((s, e, k, n) for bb, s, e, k, n in parts if bb == b)
            assert [k for _, _, k, _ in mine] == list(range(len(mine))) and all(n == len(mine) for *_, n in mine)
            assert mine[0][0] == 0 and mine[-1][1] == t and all(a[1] == b2[0] for a, b2 in zip(mine, mine[1:]))


def test_fixed_chunks_balance_serving_batches():
    for slots, tile in ((132, 128), (264, 32)):
        for mean in (4096, 16384):
            ratios = {}
            for name in ("equal", "fixed"):
                r = []
                for seed in range(4):
                    tiles = batch(seed, mean=mean, tile=tile)
                    cut = model.equal_parts(tiles, slots) if name == "equal" else model.fixed_chunks(tiles, slots, slots + 128)
                    sizes = [e - s for _, s, e, _, _ in cut[1]]
                    r.append(model.span(sizes, slots) / ((sum(sizes) + len(sizes)) / slots))
                ratios[name] = sum(r) / len(r)
            assert ratios["fixed"] < 1.12 < 1.4 < ratios["equal"], (slots, tile, mean, ratios)

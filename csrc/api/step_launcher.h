// The decoder's repeated-call fast path (step_launcher.cpp): registers
// mla_decode._C.LayoutStamp and mla_decode._C.StepLauncher on the module.
#pragma once

#include <torch/extension.h>

namespace mla::api {

void bind_step_launcher(pybind11::module& m);

}  // namespace mla::api

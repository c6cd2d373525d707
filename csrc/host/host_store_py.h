// Python binding of elastic::HostStore (host_store_py.cpp); called from csrc/module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace elastic {
void bind_host_store(pybind11::module_& m);
}  // namespace elastic

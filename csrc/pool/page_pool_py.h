// Python binding of elastic::PagePool (page_pool_py.cpp); called from csrc/module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace elastic {
void bind_page_pool(pybind11::module_& m);
}  // namespace elastic

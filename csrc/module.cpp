// The Python module elastic_kernels._C. Importing it runs the static registrations of every
// translation unit (TORCH_LIBRARY schemas, CPU and CUDA impls) and exposes the stateful
// objects (the page pool, the host store) through pybind11.
#include <torch/extension.h>

#include "host/host_store_py.h"
#include "pool/page_pool_py.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "elastic-kernels compiled extension";
  m.def("cuda_built", []() {
#ifdef ELASTIC_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build carries the CUDA kernels.");
  elastic::bind_page_pool(m);
  elastic::bind_host_store(m);
}

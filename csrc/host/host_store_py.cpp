// pybind11 face of elastic::HostStore. The Python class users see is
// elastic_kernels.HostStore (elastic_kernels/host_store.py), a thin wrapper over the
// `_C.HostStore` defined here. Calls that may take long (create/attach of a large segment:
// fallocate zeroes every page; pin: cudaHostRegister) release the GIL.
#include "host_store_py.h"

#include <torch/extension.h>

#include <cerrno>

#include "host_store.h"

namespace py = pybind11;

namespace elastic {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// A uint8 CPU tensor over the whole mapping. Its storage's deleter holds a reference to the
// store, so the mapping outlives every tensor made from it (a tensor never dangles, whatever
// the Python face does with the store).
at::Tensor whole_tensor(const std::shared_ptr<HostStore>& self) {
  std::shared_ptr<HostStore> keep = self;
  return at::from_blob(
      self->data(), {self->nbytes()}, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace

void bind_host_store(py::module_& m) {
  // HostStoreError -> elastic_kernels.host_store.HostStoreError(errno, message), an OSError
  // (a Python class, so that it exists where _C does not). std::invalid_argument maps to
  // ValueError by pybind11's default.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const HostStoreError& e) {
      py::object cls;
      try {
        cls = py::module_::import("elastic_kernels.host_store").attr("HostStoreError");
      } catch (py::error_already_set&) {
        PyErr_Clear();
        cls = py::reinterpret_borrow<py::object>(PyExc_OSError);
      }
      py::object exc = cls(e.error_code(), e.what());
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::class_<HostStore, std::shared_ptr<HostStore>>(
      m, "HostStore", "One shared host-memory segment per node; use elastic_kernels.HostStore.")
      .def_static("create", &HostStore::create, py::arg("nbytes"), py::arg("kind") = "memfd", Release())
      .def_static("attach", &HostStore::attach, py::arg("handle"), py::arg("nbytes"), Release())
      .def_static("can_pin", &HostStore::can_pin, Release())
      .def_property_readonly("handle", &HostStore::handle)
      .def_property_readonly("name", &HostStore::name)
      .def_property_readonly("kind", &HostStore::kind)
      .def_property_readonly("creator", &HostStore::creator)
      .def_property_readonly("nbytes", &HostStore::nbytes)
      .def_property_readonly("data_ptr", [](const HostStore& s) { return reinterpret_cast<uintptr_t>(s.data()); })
      .def_property_readonly("fd_open", &HostStore::fd_open)
      .def_property_readonly("pinned", &HostStore::pinned)
      .def_property_readonly("pinned_bytes", &HostStore::pinned_bytes)
      .def("close_fd", &HostStore::close_fd, Release())
      .def("pin", &HostStore::pin, Release())
      .def("unpin", &HostStore::unpin, Release())
      .def("tensor", &whole_tensor);
}

}  // namespace elastic

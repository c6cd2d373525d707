// pybind11 face of elastic::PagePool. The Python class users see is elastic_kernels.PagePool
// (elastic_kernels/pool.py), a thin wrapper over the `_C.PagePool` defined here.
//
// Every call releases the GIL before it takes the pool's mutex ([Note: locking and the GIL] in
// page_pool.cpp). pybind11 converts arguments before the call guard releases the GIL and
// converts the result after it has taken it back, so no Python object is touched without it.
#include "page_pool_py.h"

#include <torch/extension.h>
#include <pybind11/stl.h>

#include "page_pool.h"

namespace py = pybind11;

namespace elastic {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["page_bytes"] = s.page_bytes;
  d["budget_bytes"] = s.budget_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["pinned_bytes"] = s.pinned_bytes;
  d["free_bytes"] = s.free_bytes;
  d["pending_bytes"] = s.pending_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["over_budget_bytes"] = s.over_budget_bytes;
  d["reserved_over_budget_bytes"] = s.reserved_over_budget_bytes;
  d["segments"] = s.segments;
  d["pages"] = s.pages;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["evictions"] = s.evictions;
  d["allocations"] = s.allocations;
  d["frees"] = s.frees;
  d["segment_allocs"] = s.segment_allocs;
  d["segment_releases"] = s.segment_releases;
  d["event_waits"] = s.event_waits;
  d["stream_waits"] = s.stream_waits;
  return d;
}

}  // namespace

void bind_page_pool(py::module_& m) {
  // PoolExhaustedError -> elastic_kernels.pool.PoolExhausted (a Python class, so that it exists
  // even where _C does not); PoolKeyError -> KeyError. std::invalid_argument and
  // std::out_of_range map to ValueError and IndexError by pybind11's defaults.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PoolExhaustedError& e) {
      PyObject* cls = PyExc_RuntimeError;
      py::object holder;
      try {
        holder = py::module_::import("elastic_kernels.pool").attr("PoolExhausted");
        cls = holder.ptr();
      } catch (py::error_already_set&) {
        PyErr_Clear();
      }
      PyErr_SetString(cls, e.what());
    } catch (const PoolKeyError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  py::class_<PagePool>(m, "PagePool", "Paged caching allocator; use elastic_kernels.PagePool.")
      .def(py::init<int64_t, int64_t, const std::string&, int64_t>(), py::arg("page_bytes"),
           py::arg("budget_bytes"), py::arg("device"), py::arg("segment_bytes") = PagePool::kDefaultSegmentBytes,
           Release())
      .def_property_readonly("page_bytes", &PagePool::page_bytes)
      .def_property_readonly("pages_per_segment", &PagePool::pages_per_segment)
      .def_property_readonly("budget_bytes",
                             [](const PagePool& self) {
                               py::gil_scoped_release release;
                               return self.budget_bytes();
                             })
      .def_property_readonly("closed",
                             [](const PagePool& self) {
                               py::gil_scoped_release release;
                               return self.closed();
                             })
      .def("allocate", &PagePool::allocate, py::arg("key"), py::arg("pin") = false, Release())
      .def("allocate_many", &PagePool::allocate_many, py::arg("keys"), py::arg("pin") = false, Release())
      .def(
          "get",
          [](PagePool& self, int64_t key) -> py::object {
            at::Tensor t;
            {
              py::gil_scoped_release release;
              t = self.get(key);
            }
            if (!t.defined()) return py::none();
            return py::cast(std::move(t));
          },
          py::arg("key"))
      .def("slot", &PagePool::slot, py::arg("key"), Release())
      .def("contains", &PagePool::contains, py::arg("key"), Release())
      .def("free", &PagePool::free, py::arg("key"), Release())
      .def("free_many", &PagePool::free_many, py::arg("keys"), Release())
      .def("pin", &PagePool::pin, py::arg("key"), Release())
      .def("unpin", &PagePool::unpin, py::arg("key"), Release())
      .def("pin_count", &PagePool::pin_count, py::arg("key"), Release())
      .def("priority", &PagePool::priority, py::arg("key"), Release())
      .def("set_priority", &PagePool::set_priority, py::arg("key"), py::arg("priority"), Release())
      .def("record_stream", &PagePool::record_stream, py::arg("key"), py::arg("stream_handle"), Release())
      .def("lookup_pin", &PagePool::lookup_pin, py::arg("keys"), Release())
      .def("unpin_many", &PagePool::unpin_many, py::arg("keys"), Release())
      .def("page", &PagePool::page, py::arg("slot"), Release())
      .def("drain_evicted", &PagePool::drain_evicted, Release())
      .def("set_budget", &PagePool::set_budget, py::arg("budget_bytes"), py::arg("evict_to_release") = false,
           Release())
      .def("trim", &PagePool::trim, Release())
      .def("stats",
           [](const PagePool& self) {
             PoolStats s;
             {
               py::gil_scoped_release release;
               s = self.stats();
             }
             return stats_dict(s);
           })
      .def("reset_peak", &PagePool::reset_peak, Release())
      .def("reset_counters", &PagePool::reset_counters, Release())
      .def("snapshot",
           [](const PagePool& self) {
             std::vector<SegmentInfo> segs;
             {
               py::gil_scoped_release release;
               segs = self.snapshot();
             }
             py::list out;
             for (const SegmentInfo& s : segs) {
               py::dict d;
               d["index"] = s.index;
               d["pages"] = s.pages;
               d["live"] = s.live;
               d["pinned"] = s.pinned;
               d["pending"] = s.pending;
               d["bytes"] = s.bytes;
               d["data_ptr"] = s.data_ptr;
               out.append(d);
             }
             return out;
           })
      .def("keys", &PagePool::keys, Release())
      .def("__len__", &PagePool::size, Release())
      .def("close", &PagePool::close, Release());
}

}  // namespace elastic

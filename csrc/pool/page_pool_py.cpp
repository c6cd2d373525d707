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

// Keys arrive as Python ints. pybind11's int64_t caster also takes a bool (an int subclass),
// so `key=True` would silently be key 1: every key goes through these instead.
int64_t key_of(py::handle h) {
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr())) {
    throw py::type_error(std::string("PagePool: a key must be an int, got ") + Py_TYPE(h.ptr())->tp_name);
  }
  return h.cast<int64_t>();
}

std::vector<int64_t> keys_of(py::handle seq) {
  if (PyLong_Check(seq.ptr()) || !PySequence_Check(seq.ptr())) {
    throw py::type_error(std::string("PagePool: keys must be a sequence of ints, got ") + Py_TYPE(seq.ptr())->tp_name);
  }
  py::sequence s = py::reinterpret_borrow<py::sequence>(seq);
  std::vector<int64_t> out;
  out.reserve(s.size());
  for (auto item : s) out.push_back(key_of(item));
  return out;
}

// Converts the key(s) with the GIL held, then runs `fn` without it.
template <typename F>
auto one_key(F fn) {
  return [fn](PagePool& self, py::handle key) {
    int64_t k = key_of(key);
    py::gil_scoped_release release;
    return fn(self, k);
  };
}

template <typename F>
auto many_keys(F fn) {
  return [fn](PagePool& self, py::handle keys) {
    std::vector<int64_t> ks = keys_of(keys);
    py::gil_scoped_release release;
    return fn(self, ks);
  };
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
      .def(
          "allocate",
          [](PagePool& self, py::handle key, bool pin) {
            int64_t k = key_of(key);
            py::gil_scoped_release release;
            return self.allocate(k, pin);
          },
          py::arg("key"), py::arg("pin") = false)
      .def(
          "allocate_many",
          [](PagePool& self, py::handle keys, bool pin) {
            std::vector<int64_t> ks = keys_of(keys);
            py::gil_scoped_release release;
            return self.allocate_many(ks, pin);
          },
          py::arg("keys"), py::arg("pin") = false)
      .def(
          "get",
          [](PagePool& self, py::handle key_obj) -> py::object {
            int64_t key = key_of(key_obj);
            at::Tensor t;
            {
              py::gil_scoped_release release;
              t = self.get(key);
            }
            if (!t.defined()) return py::none();
            return py::cast(std::move(t));
          },
          py::arg("key"))
      .def("slot", one_key([](PagePool& p, int64_t k) { return p.slot(k); }), py::arg("key"))
      .def("contains", one_key([](PagePool& p, int64_t k) { return p.contains(k); }), py::arg("key"))
      .def("free", one_key([](PagePool& p, int64_t k) { p.free(k); }), py::arg("key"))
      .def("free_many", many_keys([](PagePool& p, const std::vector<int64_t>& k) { p.free_many(k); }), py::arg("keys"))
      .def("pin", one_key([](PagePool& p, int64_t k) { p.pin(k); }), py::arg("key"))
      .def("unpin", one_key([](PagePool& p, int64_t k) { p.unpin(k); }), py::arg("key"))
      .def("pin_count", one_key([](PagePool& p, int64_t k) { return p.pin_count(k); }), py::arg("key"))
      .def("priority", one_key([](PagePool& p, int64_t k) { return p.priority(k); }), py::arg("key"))
      .def(
          "set_priority",
          [](PagePool& self, py::handle key, int64_t priority) {
            int64_t k = key_of(key);
            py::gil_scoped_release release;
            self.set_priority(k, priority);
          },
          py::arg("key"), py::arg("priority"))
      .def(
          "record_stream",
          [](PagePool& self, py::handle key, StreamHandle stream_handle) {
            int64_t k = key_of(key);
            py::gil_scoped_release release;
            self.record_stream(k, stream_handle);
          },
          py::arg("key"), py::arg("stream_handle"))
      .def("lookup_pin", many_keys([](PagePool& p, const std::vector<int64_t>& k) { return p.lookup_pin(k); }),
           py::arg("keys"))
      .def("unpin_many", many_keys([](PagePool& p, const std::vector<int64_t>& k) { p.unpin_many(k); }),
           py::arg("keys"))
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

// Conversions the binding units share: metadata, received messages, timeouts and a
// call's end as Python sees them (bindings.h declares them).
#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

Metadata to_metadata(const py::object& o) {
  Metadata md;
  if (o.is_none()) return md;
  // Most calls carry none: an empty list costs no iterator.
  if ((PyList_CheckExact(o.ptr()) && PyList_GET_SIZE(o.ptr()) == 0) ||
      (PyTuple_CheckExact(o.ptr()) && PyTuple_GET_SIZE(o.ptr()) == 0))
    return md;
  for (auto item : o) {
    auto t = py::reinterpret_borrow<py::tuple>(item);
    if (t.size() != 2) throw py::value_error("metadata entries must be (key, value) pairs");
    md.emplace_back(t[0].cast<std::string>(), t[1].cast<std::string>());
  }
  return md;
}

py::list from_metadata(const Metadata& md) {
  py::list l;
  for (auto& kv : md) l.append(py::make_tuple(py::str(kv.first), py::bytes(kv.second)));
  return l;
}

py::str method_name(const std::string& method) {
  // A server's calls name a few methods, again and again: the same str object each time
  // (its hash computed once) saves a decode per call and a hash per lookup. Under the
  // GIL; never freed, as the interpreter may be gone at exit. A peer that names many
  // methods only fills it up to kMax.
  static constexpr size_t kMax = 256;
  static auto* names = new std::unordered_map<std::string, py::str>();
  auto it = names->find(method);
  if (it != names->end()) return it->second;
  // A peer's bytes: a name that is not UTF-8 reads with replacement characters, and so
  // matches no handler (UNIMPLEMENTED) instead of raising where the call is taken.
  py::str name = lenient_str(method);
  if (names->size() < kMax) names->emplace(method, name);
  return name;
}

py::tuple user_agent_only(const std::string& ua) {
  if (ua.empty()) return py::tuple();
  // Most calls carry no metadata of their own, so their metadata is the same one-entry
  // tuple every time: built once per user-agent (the facade's conversion of it is then
  // a cache hit). Under the GIL; never freed, as the interpreter may be gone at exit.
  static std::string* last_ua = new std::string();
  static py::object* last = new py::object();
  if (!*last || *last_ua != ua) {
    *last = py::make_tuple(py::make_tuple(py::str("user-agent"), py::bytes(ua)));
    *last_ua = ua;
  }
  return py::reinterpret_borrow<py::tuple>(*last);
}

py::object to_python(Payload&& p) {
  if (p.is_inline) return py::bytes(p.inline_bytes.data(), p.inline_bytes.size());
  return py::memoryview(py::cast(std::make_unique<RecvBuffer>(std::move(p))));
}

double timeout_arg(const py::object& t) {
  if (t.is_none()) return -1.0;
  return user_timeout(t.cast<double>());
}

Deadline deadline_arg(const py::object& t) {
  return t.is_none() ? Deadline::never() : Deadline::after_seconds(t.cast<double>());
}

py::tuple status_tuple(Stream& s) {
  std::lock_guard<std::mutex> g(s.mu);
  return py::make_tuple(s.code, py::str(s.details), from_metadata(s.trailing_md));
}

py::tuple status_tuple(const CallEnd& e) {
  return py::make_tuple(e.code, lenient_str(e.details), py::list());
}

py::tuple unary_tuple(const CallEnd& e) {
  return py::make_tuple(e.code, lenient_str(e.details), py::list(), py::list(), py::none());
}

}  // namespace bindings
}  // namespace argrpc

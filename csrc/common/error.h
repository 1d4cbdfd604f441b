// Setup-time failures. Never thrown on a call path (those end calls with a status);
// the bindings turn CoreError into argrpc._core.CoreError with the message intact.
#pragma once
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace argrpc {
struct CoreError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}
}  // namespace argrpc

// Who is at the other end of a connection, as the negotiation saw it.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace argrpc {

// `name` is argrpc's own name for the peer (its fabric's view, e.g. "shm:pid=12"), used in
// the connection's log lines and errors. The rest is what grpc reported for the gRPC call
// that negotiated the connection, so that a server's fast-path call answers peer(),
// auth_context() and the user-agent as that gRPC call did: the same client, the same
// identity.
struct PeerInfo {
  PeerInfo() = default;
  PeerInfo(std::string n) : name(std::move(n)) {}  // NOLINT: a bare name converts
  PeerInfo(const char* n) : name(n) {}               // NOLINT: and so does a literal

  std::string name;
  std::string address;     // grpc's peer(): "ipv4:127.0.0.1:53124", "unix:..."; empty: name
  std::string user_agent;  // what the peer's gRPC channel sent
  std::vector<std::pair<std::string, std::string>> auth;  // auth_context(), one pair per value
  std::string identity_key;                                // peer_identity_key(); empty: none

  const std::string& grpc_address() const { return address.empty() ? name : address; }
};

}  // namespace argrpc

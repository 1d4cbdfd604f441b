// A connection between two engines over one fabric: calls multiplexed by stream id,
// eager batches coalesced up to acc_size, rendezvous pulled in chunks, ring credits,
// per-stream windows, deadlines and cancellation. Any thread may drive it (progress());
// the engine's progress thread does when nobody else is.
#pragma once
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/fork.h"
#include "common/status.h"
#include "engine/frame.h"
#include "engine/peer_info.h"
#include "engine/probes.h"
#include "engine/stream.h"
#include "engine/transport_stats.h"
#include "fabric/fabric.h"
#include "engine_config.h"

namespace argrpc {

class Engine;
class Server;

// What one submit() puts on the wire for a stream, in this order, in one batch when
// it fits.
struct Outgoing {
  const Metadata* initial_md = nullptr;  // server: initial metadata (client headers are implicit)
  const uint8_t* msg = nullptr;
  size_t msg_len = 0;
  bool has_msg = false;
  bool half_close = false;
  bool trailers = false;
  uint32_t code = 0;
  const std::string* details = nullptr;
  const Metadata* trailing = nullptr;
};

// Why a connection failed, kept apart so that handles outliving the connection (a
// channel looking again later) can still say why.
struct Epitaph {
  std::mutex mu;
  std::string why;
  uint32_t code = 0;  // what fail() ended client streams with
  std::string text() {
    std::lock_guard<std::mutex> g(mu);
    return why;
  }
};

// What a send that must not wait (an asyncio call's) did.
enum class SendResult { kEnded, kSent, kWouldBlock };

struct CallEnd {
  uint32_t code = 0;
  std::string details;
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // connection.cc: construction, liveness, failure.
  Connection(Engine* engine, std::unique_ptr<Fabric> fabric, const ConnConfig& cfg,
             std::shared_ptr<Server> server, PeerInfo peer);
  ~Connection();

  Fabric& fabric() { return *fabric_; }
  const PeerInfo& peer() const { return peer_; }
  const std::string& peer_name() const { return peer_.name; }
  // False after the peer or this side ended it, and in a forked child (the connection
  // is the parent's).
  bool alive() const {
    return !dead_.load(std::memory_order_acquire) && born_ == fork_generation();
  }
  bool inherited() const { return born_ != fork_generation(); }
  std::string error() const { return epitaph_->text(); }
  const std::shared_ptr<Epitaph>& epitaph() const { return epitaph_; }
  uint64_t serial = 0;  // the engine's id for it
  // The engine's hot set (engine/engine.h): whether this is in it, and when a call last
  // started here or a doorbell rang for it.
  std::atomic<bool> hot{false};
  std::atomic<uint64_t> heated_us{0};
  // Whether it may leave the hot set: no READ of it is under way (a fabric whose reads
  // complete locally announces them only to a poller of hot connections).
  bool may_cool() const { return reads_out_.load(std::memory_order_relaxed) == 0; }
  // When this connection last had anything to do: heard from, or heated.
  uint64_t last_active_us() const {
    return std::max(last_heard_us_.load(std::memory_order_relaxed),
                    heated_us.load(std::memory_order_relaxed));
  }
  // The engine's counters of this connection's transport (engine/transport_stats.h).
  TransportCounters& counters() { return counters_; }
  // Client side: the label its calls' records carry (common/call_stats.h); calls that
  // start after this carry the new one.
  void set_stats_target(std::string target);

  // The engine's sweep: expires streams past their deadline, returns ring credits owed
  // too long and PINGs a silent peer while calls are in flight. Returns when this
  // connection next needs one (now_us() scale): the earliest deadline or keepalive
  // check.
  uint64_t sweep(uint64_t now_us);
  // Lazy credits (verbs): when the debt falls due (now_us() scale; max: none owed), and
  // paying it then; the engine's cool() asks, on a thread about to poll.
  uint64_t credits_due_at() const;
  void return_credits_if_due(uint64_t now_us);
  // Ends every stream with `code`/`why` and tears the connection down. False if it had
  // already failed (or is the parent's, in a forked child).
  bool fail(uint32_t code, const std::string& why);
  // A deliberate close (a channel's close(), a server's stop()): a client first cancels
  // its calls, as grpc's channel does, so the peer sees each one CANCELLED before the
  // hang-up and loses none; then what is queued goes out and the connection fails with
  // CANCELLED `why`.
  void close(const std::string& why);
  // Calls are started in groups (a channel's calls on a connection it shares with other
  // channels). Ending a group cancels its live calls with CANCELLED `why` (RST to the
  // peer) and ends any call started in it later at birth, as closing a connection of its
  // own would; the connection and the other groups' calls go on. forget_group() drops
  // the record once no call can be started in the group any more.
  void end_group(uint64_t group, const std::string& why);
  void forget_group(uint64_t group);

  // connection_progress.cc: reading the peer's batches.
  // Non-blocking; returns whether it did any work.
  bool progress();
  // The peer hung up: reads everything it wrote before it did (its last answers and
  // trailers), so those calls end as the peer ended them, not with the hang-up.
  void drain();

  // connection_send.cc: the send side.
  // Before a deliberate close: writes the control frames still queued (the TRAILERS
  // of calls just cancelled), so the peer learns how they ended.
  void flush_pending();

  // connection_streams.cc: stream lifetimes.
  // Expires the streams past their deadline; returns the earliest deadline left
  // (UINT64_MAX: none).
  uint64_t sweep_deadlines();
  // Client: RST + local end. Server: TRAILERS with code to the client + cancelled.
  bool cancel(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details);
  // The application dropped its handle: cancel if still running, release held pulls.
  void abandon(const std::shared_ptr<Stream>& s);
  // Whether abandon(s) has anything to do: false once the call ended and holds no
  // message, the usual state of a handle dropped after its call ended, so the binding
  // keeps the GIL (giving it up lets another thread take it for as long as it likes).
  bool abandon_needed(const std::shared_ptr<Stream>& s);

  // connection_rendezvous.cc: large messages, read from the sender's pool.
  // A view of peer memory was released: FIN it.
  void release_view(uint64_t rdv_id, uint64_t len);

  // connection_api.cc: the calls' own operations.
  // Client side. Headers go out now, or with the first message when !send_headers_now.
  std::shared_ptr<Stream> start_call(const std::string& method, const Metadata& md, double timeout,
                                     bool send_headers_now, uint64_t group = 0);
  // Client: the call ended UNAVAILABLE before its HEADERS were encoded for the wire, so
  // the peer never heard of it and it may be started again elsewhere (a transparent
  // retry).
  bool never_sent(const std::shared_ptr<Stream>& s);
  // Server side.
  bool send_initial_metadata(const std::shared_ptr<Stream>& s, const Metadata& md);
  bool finish(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details,
              const Metadata& trailing, const uint8_t* msg, size_t len, bool has_msg);
  // Both sides. A false return means the stream already ended.
  bool send(const std::shared_ptr<Stream>& s, const uint8_t* msg, size_t len, bool half_close);
  bool half_close(const std::shared_ptr<Stream>& s);
  // Waits for the next message. False: no more (half-closed by peer, or ended).
  bool recv(const std::shared_ptr<Stream>& s, Payload* out);
  // The same without waiting, for an event loop. kWouldBlock: the stream window or the
  // pool has no room now; the stream's watch fires when the window opens (the pool
  // does not notify: the caller retries).
  SendResult try_send(const std::shared_ptr<Stream>& s, const uint8_t* msg, size_t len,
                      bool half_close);
  SendResult try_finish(const std::shared_ptr<Stream>& s, uint32_t code,
                        const std::string& details, const Metadata& trailing,
                        const uint8_t* msg, size_t len, bool has_msg);
  // 1: a message in *out; 0: none yet; -1: no more (half-closed by peer, or ended).
  int try_recv(const std::shared_ptr<Stream>& s, Payload* out);
  // Waits for the initial metadata (true) or the end of the call (false).
  bool wait_initial_metadata(const std::shared_ptr<Stream>& s);
  // Waits for the end of the call or `limit`; true if ended.
  bool wait_end(const std::shared_ptr<Stream>& s, const Deadline& limit);

  // connection_probes.cc: probes for the hostile-peer and fail-point tests, each acting
  // as a hostile or vanishing peer would. All but probe_raw_batch() give the connection
  // its Probes on first use; probe_enable() does only that, before the traffic a test
  // inspects.
  void probe_enable() { probes_.enable(); }
  // What the last RTS received announced (zeros if none came since the probes exist).
  RemoteRef probe_last_rts(uint64_t* len);
  // Writes `p` as one batch, unframed, as a hostile peer could (tests/test_hostile_peer.py).
  bool probe_raw_batch(const uint8_t* p, size_t len);
  // A READ of arbitrary peer memory: "" when it completed, else why it did not (the
  // connection's error once the fabric failed it).
  std::string probe_read(const RemoteRef& src, size_t len, double timeout);
  // The next time this connection reaches `p`, it fails there (once).
  void probe_fail_at(FailPoint p) { probes_.enable().arm(p); }

 private:
  // connection.cc
  void protocol_error(const std::string& what);
  // sweep()'s keepalive part; returns when it next needs a look.
  uint64_t keepalive(uint64_t now_us);
  void fail_point(FailPoint p) {
    Probes* const probes = probes_.get();
    if (probes && probes->fire(p))
      fail(kUnavailable, "argrpc: connection failed at a test fail point");
  }

  // connection_progress.cc
  bool progress_locked();
  bool handle_batch(uint32_t imm);

  // connection_credits.cc: returning the peer's ring credits (poll lock for the first).
  void consumed_locked();
  void return_credits();
  // sweep()'s part: pays what is owed once it is credit_owe_ms old, or undated.
  void sweep_credits(uint64_t now_us);

  // connection_frames.cc: what each frame kind received does. False: the connection
  // failed (a protocol error), so the rest of the batch must not be read.
  bool handle_frame(const FrameHead& h, const uint8_t* p);
  bool on_headers(const FrameHead& h, Reader& r);
  bool on_initial_metadata(const FrameHead& h, Reader& r);  // client
  bool on_new_call(const FrameHead& h, Reader& r);          // server
  bool on_message(const FrameHead& h, const uint8_t* p);
  bool on_rts(const FrameHead& h, Reader& r);
  bool on_fin(Reader& r);
  bool on_half_close(const FrameHead& h);
  bool on_trailers(const FrameHead& h, Reader& r);
  bool on_rst(const FrameHead& h, Reader& r);
  bool on_window(const FrameHead& h, Reader& r);
  bool on_ping(const FrameHead& h);
  bool malformed(const char* what);
  void oversize(const std::shared_ptr<Stream>& s, uint64_t n);

  // connection_send.cc. submit() puts one Outgoing on the wire in the steps that follow
  // it here; the *_locked ones run under send_mu_.
  struct SubmitPlan;
  // would_block non-null: never wait for window or pool room; set it instead.
  bool submit(const std::shared_ptr<Stream>& s, const Outgoing& o, bool* would_block = nullptr);
  SendResult try_submit(const std::shared_ptr<Stream>& s, const Outgoing& o);
  bool may_submit(const std::shared_ptr<Stream>& s);
  bool claim_headers(Stream& s, const Outgoing& o, SubmitPlan* plan);
  bool reserve_window(const std::shared_ptr<Stream>& s, size_t n, bool* would_block);
  bool append_and_flush(const std::shared_ptr<Stream>& s, const Outgoing& o, SubmitPlan* plan);
  bool register_client_stream_locked(const std::shared_ptr<Stream>& s);
  bool append_frames_locked(const Stream& s, const Outgoing& o, SubmitPlan* plan);
  template <class Encode>
  bool append_locked(uint8_t type, uint64_t stream, size_t len, Encode&& encode);
  void submit_failed(const std::shared_ptr<Stream>& s);
  bool room_locked(size_t n);
  bool flush_locked();
  // send_mu_, telling this thread's wait hook first if another thread holds it.
  std::unique_lock<std::mutex> lock_send();
  void queue_ctrl(uint8_t type, uint64_t stream, const std::vector<uint8_t>& body,
                  uint8_t flags = 0);
  void flush_ctrl_locked();
  void try_flush_ctrl();

  // connection_rendezvous.cc. Sender side: a message's pool block, announced until the
  // peer's FIN. Receiver side: pulls, by views or fabric READs.
  // A pool block for a message of `len` (waits for room unless would_block is given);
  // invalid if the stream ended instead.
  Block take_block(const std::shared_ptr<Stream>& s, size_t len, bool* would_block);
  // take_block(), and a block the fabric can announce to the peer; else the message's
  // call ends RESOURCE_EXHAUSTED with the reason and the connection goes on.
  Block exposable_block(const std::shared_ptr<Stream>& s, size_t len, bool* would_block);
  // Ends the call of a message that cannot be sent, RESOURCE_EXHAUSTED with `why`.
  void refuse_message(const std::shared_ptr<Stream>& s, const std::string& why);
  // Copies the message into `block` and announces it: its rendezvous id, or 0 if the
  // connection failed during the copy (the block goes back to the pool).
  uint64_t expose_message(const Outgoing& o, Block block, RemoteRef* ref);
  bool withdraw(uint64_t rdv_id);
  void on_read_done(uint64_t wr_id);
  void start_pull(const std::shared_ptr<Pull>& pull);
  bool try_view(const std::shared_ptr<Pull>& pull);
  void post_reads(const std::shared_ptr<Pull>& pull);
  void start_queued_pulls();
  void queue_fin(uint64_t rdv_id);

  // connection_api.cc: the next message once it is ready (the predicate held).
  bool take_message(const std::shared_ptr<Stream>& s, Payload* out);

  // connection_streams.cc
  std::shared_ptr<Stream> find(uint64_t id);
  // Every stream of this connection is made here and stays in live_ until destroyed,
  // so fail() reaches each one that anybody could wait on, registered by id or not.
  std::shared_ptr<Stream> new_stream(uint64_t id, const Deadline& dl, std::string method,
                                     uint64_t group = 0);
  friend class Stream;  // ~Stream leaves live_
  void forget_stream(Stream* s);
  // Every stream that still exists: what fail() and close() visit.
  std::vector<std::shared_ptr<Stream>> live_streams();
  // Local end of a stream: drops it from the map, releases its pulls unless keep_inbox
  // (a normal end keeps what already arrived), wakes waiters. False if already ended.
  bool end_stream(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details,
                  bool cancelled, Metadata* trailing, bool keep_inbox);
  // The call stats' records of a stream's birth and of its end (as end_stream decided it).
  void record_start(Stream& s);
  void record_end(const Stream& s, uint32_t code, uint64_t sent, uint64_t rcvd);
  void release_inbox_locked(Stream& s, std::vector<uint64_t>* fins);
  // After fail(): ends `s` with the connection's error if it still runs, and if it had
  // ended with messages still arriving, fails it too (they never will). True if it
  // changed the call's outcome.
  bool end_failed(const std::shared_ptr<Stream>& s);
  // The stream's deadline passed: end it and tell the peer.
  void expire(const std::shared_ptr<Stream>& s);
  // A waiter saw the deadline pass: the call ends DEADLINE_EXCEEDED, unless its sender
  // waits for pool room, which ends it at that deadline with the cause (RESOURCE_EXHAUSTED
  // naming the pool: Stream::awaiting_pool); then this waits for that end instead. False
  // if `limit` came first (the call has not ended).
  bool end_at_deadline(const std::shared_ptr<Stream>& s, const Deadline& limit);
  // Ends the stream here with code/why and tells the peer: a server sends TRAILERS with
  // the same status, a client RST(rst_code). False if it had already ended. `keep_inbox`:
  // what arrived before stays readable, ahead of the status.
  bool abort_stream(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& why,
                    uint32_t rst_code, bool keep_inbox = false);

  // connection_wait.h: spins driving progress(), then sleeps on the stream.
  template <class Pred>
  bool wait(const std::shared_ptr<Stream>& s, const Deadline& dl, Pred pred);

  Engine* const engine_;
  std::unique_ptr<Fabric> fabric_;
  const ConnConfig cfg_;
  const std::shared_ptr<Server> server_;
  const PeerInfo peer_;
  const bool client_;
  TransportCounters& counters_;
  std::mutex stats_target_mu_;
  std::shared_ptr<const std::string> stats_target_;
  std::atomic<bool> dead_{false};
  const uint64_t born_ = fork_generation();
  const std::shared_ptr<Epitaph> epitaph_ = std::make_shared<Epitaph>();
  ProbeSlot probes_;

  // Streams: by id while they run (what frames address), and all of them, ended or
  // not, while they exist (what fail() must reach). Nothing is destroyed under live_mu_.
  std::mutex streams_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Stream>> streams_;
  std::mutex live_mu_;
  std::unordered_map<Stream*, std::weak_ptr<Stream>> live_;
  std::unordered_map<uint64_t, std::string> ended_groups_;  // group -> why; under live_mu_
  uint64_t next_stream_id_ = 1;
  uint64_t last_peer_stream_ = 0;

  // Send side: the batch being built and the ring position in the peer's ring.
  std::mutex send_mu_;
  std::atomic<int> appenders_{0};
  std::vector<uint8_t> batch_;
  uint64_t wpos_ = 0, wbatches_ = 0;
  uint64_t wfree_ = 0;  // where the last restart began: all before it is free (flush_locked)
  std::mutex ctrl_mu_;
  std::vector<std::vector<uint8_t>> ctrl_;
  std::atomic<bool> ctrl_pending_{false};

  // Rendezvous, sender side: blocks announced to the peer until its FIN.
  std::mutex exposed_mu_;
  std::unordered_map<uint64_t, Block> exposed_;
  uint64_t next_rdv_ = 1;

  // Receive side (poll lock).
  std::mutex poll_mu_;
  std::atomic<bool> kick_{false};
  uint64_t rpos_ = 0, rbatches_ = 0;
  std::atomic<uint64_t> last_heard_us_{0};  // any completion, ours included
  std::atomic<uint64_t> last_recv_us_{0};   // the last batch from the peer
  uint64_t ping_sent_us_ = 0;  // the oldest unanswered PING (0: none); progress thread only
  uint64_t peer_consumed_seen_ = 0;  // the peer's returned credits at the last keepalive (same)
  std::vector<uint8_t> scratch_;
  // Ring credits: what the poll lock's holder consumed, what went back to the peer
  // (credit_mu_, which keeps returns in order so the peer never sees them go back) and
  // the debt the sweep watches (progress thread only).
  std::atomic<uint64_t> consumed_bytes_{0}, consumed_batches_{0};
  std::mutex credit_mu_;
  uint64_t returned_bytes_ = 0, returned_batches_ = 0;
  // When the oldest batch not paid for was read (now_us() scale; 0: none owed).
  std::atomic<uint64_t> debt_since_us_{0};
  struct Read {
    std::shared_ptr<Pull> pull;
    size_t len;
  };
  std::unordered_map<uint64_t, Read> reads_;
  std::atomic<int64_t> reads_out_{0};  // reads_.size(), for the engine's cool()
  uint64_t next_wr_ = 1;
  std::atomic<uint64_t> leased_bytes_{0};  // peer memory held through views
  std::mutex pullq_mu_;
  std::vector<std::shared_ptr<Pull>> pullq_;
  // pullq_ is not empty: every progress pass asks, and almost none has a pull to start.
  std::atomic<bool> pullq_queued_{false};
};

}  // namespace argrpc

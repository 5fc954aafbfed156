// The native gRPC transport: gRPC C++ moves bytes, Python holds every rule (design: serve/transport/native.py
// and docs/serving.md "One front end").
//
// Every method arrives through one generic service as bytes. C++ knows no message type, no method but by
// name, no limit but gRPC's own receive size, and no status text: it hands Python what arrived and sends back
// what Python answers.
//
// gRPC's asynchronous API, one completion queue, three threads: the POLLER (C++) polls the queue itself (it is
// the thread that reads the socket) and turns each completion into an event for Python at once; Python's pump
// takes the events (`next`); the WRITER (C++) sends the answers Python hands over. gRPC's callback API, used
// before, ran each reaction through two threads of its own (an event-engine poller, then a "nexting" thread):
// one wake-up and ~100-150 µs of CPU more per call (docs/performance.md, "A completion queue of our own").
//
//   next(timeout)   -> every event queued since the last call, in ONE wake-up (the GIL is released while
//                      waiting): (START, id, method, first message | None, metadata, seconds to deadline:
//                      centuries when the client set none, arrival: CLOCK_MONOTONIC seconds, Python's
//                      time.monotonic(), when the call's request had been read), (MESSAGE, id, bytes) and
//                      (HALF_CLOSE, id) for streaming methods, (CANCEL, id) when the client or its deadline
//                      ended a call Python had not finished.
//   write(id, bytes)              a response message of a streaming call (sent in order)
//   finish(id, code, text, bytes, here) the call's status, after its last message (bytes: a unary answer): handed
//                                to the writer thread, which sends it (the caller goes on at once), or with `here`
//                                sent on the calling thread, the GIL released (no wake-up of the writer: for a
//                                thread that has nothing else to do meanwhile). gRPC's write path never holds the GIL
//
// A unary call is one START event with its request (None if the client sent none). A cancelled call is
// ended here at once; Python's later finish is ignored.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <pthread.h>
#include <time.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

enum Kind { START = 0, MESSAGE = 1, HALF_CLOSE = 2, CANCEL = 3 };

struct Event {
  Kind kind;
  int64_t id;
  std::string method;
  std::optional<std::string> payload;
  std::vector<std::pair<std::string, std::string>> metadata;
  std::optional<double> remaining;
  double arrived = 0;  // CLOCK_MONOTONIC seconds (Python's time.monotonic()): a START's arrival
};

// Now on the clock Python's time.monotonic() reads, so that a call's latency and deadline count from its arrival,
// not from when the pump took it (under load, a burst waits for the pump: ~3 ms at 32 clients on 2 cores).
double monotonic_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

std::string dump(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  out.reserve(buffer.Length());
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer buffer_of(std::string&& bytes) {
  auto* held = new std::string(std::move(bytes));
  grpc::Slice slice(const_cast<char*>(held->data()), held->size(),
                    [](void* p) { delete static_cast<std::string*>(p); }, held);
  return grpc::ByteBuffer(&slice, 1);
}

struct Answer {  // a call's status and its last message (a unary answer), from Python
  int64_t id;
  int code;
  std::string message;
  std::optional<std::string> payload;
};

class Transport;

enum Op { REQUEST = 0, READ = 1, WRITE = 2, DONE = 3 };

struct Call;
struct Tag {
  Call* call;
  Op op;
};

// One call, from the request gRPC hands over to the done tag. Python-side operations (write / finish, any thread)
// and the completions (the polling thread) share `mu`. Owned by the transport's map (a shared_ptr) from its
// arrival until its last operation completed after the done tag; a Python operation holds its own reference while
// it runs, so the call outlives it, and once `closed` it starts nothing.
struct Call {
  explicit Call(Transport* t) : t(t), stream(&ctx) {}
  Transport* t;
  grpc::GenericServerContext ctx;
  grpc::GenericServerAsyncReaderWriter stream;
  Tag request_tag{this, REQUEST}, read_tag{this, READ}, write_tag{this, WRITE}, done_tag{this, DONE};
  int64_t id = 0;
  bool streaming = false;
  std::mutex mu;
  grpc::ByteBuffer read_buf;
  std::deque<grpc::ByteBuffer> writes;
  grpc::ByteBuffer current;
  grpc::Status status;
  bool started = false, reading = false, writing = false, finishing = false, finished = false, done = false,
       closed = false;

  void Write(std::string&& bytes);
  void Finish(grpc::Status s, std::optional<std::string>&& last);
  void Finish(Answer&& a) {
    Finish(grpc::Status(static_cast<grpc::StatusCode>(a.code), a.message), std::move(a.payload));
  }
  void Read();  // under mu
  void Pump();  // under mu
};

class Transport {
 public:
  Transport() = default;
  ~Transport() {
    try {
      stop(0.0);
    } catch (...) {
    }
  }

  // Listens on `address`; tls: None (plaintext) or (key PEM, cert PEM, client CA PEM or "" for no mTLS).
  int start(const std::string& address, int64_t max_receive_bytes, py::object tls,
            const std::vector<std::string>& streaming_methods) {
    streaming_.insert(streaming_methods.begin(), streaming_methods.end());
    std::shared_ptr<grpc::ServerCredentials> creds;
    if (tls.is_none()) {
      creds = grpc::InsecureServerCredentials();
    } else {
      auto t = tls.cast<std::tuple<std::string, std::string, std::string>>();
      grpc::SslServerCredentialsOptions options(
          std::get<2>(t).empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      options.pem_root_certs = std::get<2>(t);
      options.pem_key_cert_pairs.push_back({std::get<0>(t), std::get<1>(t)});
      creds = grpc::SslServerCredentials(options);
    }
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(address, creds, &port);
    builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(max_receive_bytes, INT32_MAX)));
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterAsyncGenericService(&service_);
    cq_ = builder.AddCompletionQueue();
    {
      py::gil_scoped_release unlocked;
      server_ = builder.BuildAndStart();
    }
    if (!server_ || port == 0) throw std::runtime_error("cannot listen on " + address);
    for (int i = 0; i < kWaiting; ++i) await_call();
    poller_ = std::thread([this] { poll_loop(); });
    writer_ = std::thread([this] { write_loop(); });
    return port;
  }

  // Every queued event (an empty list after `timeout` s with none, or once stopped).
  py::list next(double timeout) {
    std::deque<Event> taken;
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return !events_.empty() || stopped_; });
      taken.swap(events_);
    }
    py::list out;
    for (auto& e : taken) {
      switch (e.kind) {
        case START: {
          py::list metadata;
          for (auto& kv : e.metadata) metadata.append(py::make_tuple(kv.first, py::bytes(kv.second)));
          out.append(py::make_tuple(static_cast<int>(START), e.id, e.method,
                                    e.payload ? py::object(py::bytes(*e.payload)) : py::object(py::none()),
                                    metadata,
                                    e.remaining ? py::object(py::float_(*e.remaining)) : py::object(py::none()),
                                    e.arrived));
          break;
        }
        case MESSAGE:
          out.append(py::make_tuple(static_cast<int>(MESSAGE), e.id, py::bytes(*e.payload)));
          break;
        default:
          out.append(py::make_tuple(static_cast<int>(e.kind), e.id));
      }
    }
    return out;
  }

  void write(int64_t id, py::bytes payload) {
    std::string bytes = payload;
    py::gil_scoped_release unlocked;
    if (auto c = find(id)) c->Write(std::move(bytes));
  }

  // One call's status and last message, handed to the writer thread (the caller goes on at once), or sent here.
  void finish(int64_t id, int code, const std::string& message, py::object payload, bool here) {
    Answer a{id, code, message, std::nullopt};
    if (!payload.is_none()) a.payload = payload.cast<std::string>();
    if (here) {
      py::gil_scoped_release unlocked;
      if (auto c = find(id)) c->Finish(std::move(a));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      finishes_.push_back(std::move(a));
    }
    write_ready_.notify_one();
  }

  // Stops listening; calls still open after `grace` s are cancelled by gRPC. The poller handles what completes
  // meanwhile, then the queue is shut down and drained.
  void stop(double grace) {
    std::unique_ptr<grpc::Server> server;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stopped_ = true;  // no call is awaited any more
      server = std::move(server_);
    }
    ready_.notify_all();
    py::gil_scoped_release unlocked;
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      writing_stopped_ = true;
    }
    write_ready_.notify_all();
    if (writer_.joinable()) writer_.join();
    if (!server) {  // never started: the queue still needs its shutdown
      if (cq_) {
        cq_->Shutdown();
        void* tag;
        bool ok;
        while (cq_->Next(&tag, &ok)) {
        }
      }
      return;
    }
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, grace) * 1e6)));
    server->Wait();
    std::vector<std::shared_ptr<Call>> open;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_closed_ = true;  // no operation starts any more (the queue is about to shut down)
      for (auto& kv : calls_) open.push_back(kv.second);
    }
    for (auto& c : open) {  // an operation that was starting has started (its completion is queued)
      std::lock_guard<std::mutex> held(c->mu);
    }
    cq_->Shutdown();
    if (poller_.joinable()) poller_.join();  // it handles what completes meanwhile, then ends
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.clear();
    }
  }

  int64_t open_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(calls_.size());
  }

  bool ops_closed() const { return ops_closed_.load(); }

  void push(Event&& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(std::move(e));
    }
    ready_.notify_one();
  }

 private:
  static constexpr int kWaiting = 32;  // calls awaited at once (each arrival awaits the next)

  void await_call() {  // under no lock; skipped once stopped
    auto* c = new Call(this);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      delete c;
      return;
    }
    c->ctx.AsyncNotifyWhenDone(&c->done_tag);
    service_.RequestCall(&c->ctx, &c->stream, cq_.get(), cq_.get(), &c->request_tag);
  }

  void handle(Tag* tag, bool ok) {
    Call* c = tag->call;
    switch (tag->op) {
      case REQUEST: {
        if (!ok) {  // the server shuts down: the done tag never comes for a call that never started
          delete c;
          return;
        }
        std::shared_ptr<Call> owned(c);
        {
          std::lock_guard<std::mutex> lock(mu_);
          c->id = ++next_id_;
          calls_[c->id] = owned;
        }
        c->streaming = streaming_.count(c->ctx.method()) > 0;
        {
          std::lock_guard<std::mutex> lock(c->mu);
          c->Read();
        }
        await_call();
        return;
      }
      case READ: {
        std::lock_guard<std::mutex> lock(c->mu);
        c->reading = false;
        if (!c->started) {
          c->started = true;
          Event e{START, c->id, c->ctx.method(), std::nullopt, {}, std::nullopt};
          if (ok && !c->streaming) e.payload = dump(c->read_buf);
          for (const auto& kv : c->ctx.client_metadata()) {
            e.metadata.emplace_back(std::string(kv.first.data(), kv.first.size()),
                                    std::string(kv.second.data(), kv.second.size()));
          }
          e.remaining = std::chrono::duration<double>(c->ctx.deadline() - std::chrono::system_clock::now()).count();
          e.arrived = monotonic_now();
          push(std::move(e));
          if (!c->streaming) break;  // a unary call: one request, answered by finish()
        }
        if (!ok) {
          if (!c->finished) push(Event{HALF_CLOSE, c->id, {}, std::nullopt, {}, std::nullopt});
          break;
        }
        push(Event{MESSAGE, c->id, {}, dump(c->read_buf), {}, std::nullopt});
        if (!c->done) c->Read();
        break;
      }
      case WRITE: {
        std::lock_guard<std::mutex> lock(c->mu);
        c->writing = false;
        if (!ok) {  // the stream broke (the client left): nothing more can be sent
          c->writes.clear();
          c->finishing = c->finished = true;
        } else {
          c->Pump();
        }
        break;
      }
      case DONE: {
        bool cancelled = false;
        {
          std::lock_guard<std::mutex> lock(c->mu);
          c->done = true;
          if (c->ctx.IsCancelled() && !c->finished) {
            cancelled = true;
            c->writes.clear();
            c->finishing = c->finished = true;
          }
        }
        if (cancelled) push(Event{CANCEL, c->id, {}, std::nullopt, {}, std::nullopt});
        break;
      }
    }
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      if (c->done && !c->reading && !c->writing && !c->closed) last = c->closed = true;
    }
    if (last) {
      std::shared_ptr<Call> gone;  // destroyed after the lock is released
      std::lock_guard<std::mutex> lock(mu_);
      auto it = calls_.find(c->id);
      if (it != calls_.end()) {
        gone = std::move(it->second);
        calls_.erase(it);
      }
    }
  }

  // The poller thread: gRPC's completions (a call arrived, a read, a write, a call done), handled as they come.
  void poll_loop() {
    pthread_setname_np(pthread_self(), "grpc-poller");
    void* tag;
    bool ok;
    while (cq_->Next(&tag, &ok)) handle(static_cast<Tag*>(tag), ok);
  }

  void write_loop() {
    pthread_setname_np(pthread_self(), "grpc-writer");
    std::deque<Answer> taken;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(write_mu_);
        write_ready_.wait(lock, [&] { return !finishes_.empty() || writing_stopped_; });
        if (finishes_.empty() && writing_stopped_) return;
        taken.swap(finishes_);
      }
      for (auto& a : taken) {
        if (auto c = find(a.id)) c->Finish(std::move(a));
      }
      taken.clear();
    }
  }

  std::shared_ptr<Call> find(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    return it == calls_.end() ? nullptr : it->second;
  }

  grpc::AsyncGenericService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
  std::unordered_set<std::string> streaming_;
  std::mutex mu_;
  std::deque<Event> events_;
  std::unordered_map<int64_t, std::shared_ptr<Call>> calls_;
  int64_t next_id_ = 0;
  bool stopped_ = false;
  std::atomic<bool> ops_closed_{false};  // set once the server is down: the queue is about to shut down
  std::condition_variable ready_;
  std::thread poller_, writer_;
  std::mutex write_mu_;
  std::condition_variable write_ready_;
  std::deque<Answer> finishes_;
  bool writing_stopped_ = false;
};

void Call::Write(std::string&& bytes) {
  std::lock_guard<std::mutex> lock(mu);
  if (closed || finished || finishing) return;
  writes.push_back(buffer_of(std::move(bytes)));
  Pump();
}

void Call::Finish(grpc::Status s, std::optional<std::string>&& last) {
  std::lock_guard<std::mutex> lock(mu);
  if (closed || finished || finishing) return;
  finishing = true;
  status = std::move(s);
  if (last) writes.push_back(buffer_of(std::move(*last)));
  Pump();
}

void Call::Read() {
  if (t->ops_closed()) return;
  reading = true;
  stream.Read(&read_buf, &read_tag);
}

void Call::Pump() {
  if (writing || finished || closed || t->ops_closed()) return;
  if (!writes.empty()) {
    current = std::move(writes.front());
    writes.pop_front();
    writing = true;
    if (finishing && writes.empty() && status.ok()) {
      finished = true;
      stream.WriteAndFinish(current, grpc::WriteOptions(), status, &write_tag);
    } else {
      stream.Write(current, &write_tag);
    }
    return;
  }
  if (finishing) {
    finished = true;
    writing = true;
    stream.Finish(status, &write_tag);
  }
}

}  // namespace

PYBIND11_MODULE(_transport, m) {
  m.doc() = "The native gRPC transport (native/transport.cc; used by serve/transport/native.py)";
  m.attr("START") = static_cast<int>(START);
  m.attr("MESSAGE") = static_cast<int>(MESSAGE);
  m.attr("HALF_CLOSE") = static_cast<int>(HALF_CLOSE);
  m.attr("CANCEL") = static_cast<int>(CANCEL);
  py::class_<Transport>(m, "Transport")
      .def(py::init<>())
      .def("start", &Transport::start, py::arg("address"), py::arg("max_receive_bytes"), py::arg("tls"),
           py::arg("streaming_methods"))
      .def("next", &Transport::next, py::arg("timeout"))
      .def("write", &Transport::write, py::arg("id"), py::arg("payload"))
      .def("finish", &Transport::finish, py::arg("id"), py::arg("code"), py::arg("message"), py::arg("payload"),
           py::arg("here") = false)
      .def("open_calls", &Transport::open_calls)
      .def("stop", &Transport::stop, py::arg("grace"));
}

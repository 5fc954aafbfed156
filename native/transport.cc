// The native gRPC transport: gRPC C++ moves bytes, Python holds every rule (design: serve/transport/native.py
// and docs/serving.md "One front end").
//
// Every method arrives through one generic callback service as bytes. C++ knows no message type, no
// method but by name, no limit but gRPC's own receive size, and no status text: it hands Python what
// arrived and sends back what Python answers.
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
// finished here with CANCELLED at once (gRPC needs Finish for every call); Python's later finish is ignored.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

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

class Transport;

struct Answer {  // a call's status and its last message (a unary answer), from Python
  int64_t id;
  int code;
  std::string message;
  std::optional<std::string> payload;
};

// One call. Python-side operations (write / finish) and gRPC's reactions share `mu_` (recursive: a
// reaction may run inline inside a Start* call made under it). Owned by the transport's map (a
// shared_ptr) until OnDone; a Python operation holds its own reference while it runs, so the reactor
// outlives it, and after OnDone (`done_`) it does nothing.
class Reactor final : public grpc::ServerGenericBidiReactor {
 public:
  Reactor(Transport* t, grpc::GenericCallbackServerContext* ctx, int64_t id, bool streaming)
      : t_(t), ctx_(ctx), id_(id), streaming_(streaming) {}

  void Begin() { StartRead(&read_); }
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  void Write(std::string&& bytes) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (done_ || finished_ || finishing_) return;
    writes_.push_back(buffer_of(std::move(bytes)));
    Pump();
  }

  void Finish(grpc::Status status, std::optional<std::string>&& last) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (done_ || finished_ || finishing_) return;
    finishing_ = true;
    status_ = std::move(status);
    if (last) writes_.push_back(buffer_of(std::move(*last)));
    Pump();
  }

 private:
  // Starts the next write, or the finish once every write went out.
  void Pump() {
    if (writing_ || finished_) return;
    if (!writes_.empty()) {
      current_ = std::move(writes_.front());
      writes_.pop_front();
      writing_ = true;
      if (finishing_ && writes_.empty() && status_.ok()) {
        finished_ = true;
        StartWriteAndFinish(&current_, grpc::WriteOptions(), status_);
      } else {
        StartWrite(&current_);
      }
      return;
    }
    if (finishing_) {
      finished_ = true;
      grpc::ServerGenericBidiReactor::Finish(status_);
    }
  }

  Transport* t_;
  grpc::GenericCallbackServerContext* ctx_;
  int64_t id_;
  bool streaming_;
  bool started_ = false;  // START delivered
  grpc::ByteBuffer read_;
  std::recursive_mutex mu_;
  std::deque<grpc::ByteBuffer> writes_;
  grpc::ByteBuffer current_;
  bool writing_ = false, finishing_ = false, finished_ = false, done_ = false;
  grpc::Status status_;
};

class Service final : public grpc::CallbackGenericService {
 public:
  explicit Service(Transport* t) : t_(t) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

 private:
  Transport* t_;
};

class Transport {
 public:
  Transport() : service_(this) {}
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
    builder.RegisterCallbackGenericService(&service_);
    {
      py::gil_scoped_release unlocked;
      server_ = builder.BuildAndStart();
    }
    if (!server_ || port == 0) throw std::runtime_error("cannot listen on " + address);
    writer_ = std::thread([this] { write_loop(); });
    return port;
  }

  // Every queued event (an empty list after `timeout` s with none, or once stopped).
  py::list next(double timeout) {
    std::deque<Event> taken;
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait_for(lock, std::chrono::duration<double>(timeout),
                      [&] { return !events_.empty() || stopped_; });
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
    if (auto r = find(id)) r->Write(std::move(bytes));
  }

  // One call's status and last message, handed to the writer thread (the caller goes on at once), or sent here.
  void finish(int64_t id, int code, const std::string& message, py::object payload, bool here) {
    Answer a{id, code, message, std::nullopt};
    if (!payload.is_none()) a.payload = payload.cast<std::string>();
    if (here) {  // on this thread, the GIL released: no wake-up of the writer
      py::gil_scoped_release unlocked;
      if (auto r = find(id)) {
        r->Finish(grpc::Status(static_cast<grpc::StatusCode>(a.code), a.message), std::move(a.payload));
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      finishes_.push_back(std::move(a));
    }
    write_ready_.notify_one();
  }

  // Stops listening; calls still open after `grace` s are cancelled by gRPC.
  void stop(double grace) {
    std::unique_ptr<grpc::Server> server;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stopped_ = true;
      server = std::move(server_);
    }
    ready_.notify_all();
    py::gil_scoped_release unlocked;
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      writing_stopped_ = true;  // the writer sends what it holds, then ends
    }
    write_ready_.notify_all();
    if (writer_.joinable()) writer_.join();
    if (server) {
      server->Shutdown(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, grace) * 1e6)));
      server->Wait();
    }
  }

  int64_t open_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(calls_.size());
  }

  // -- from the reactors (gRPC's threads) ------------------------------------------------------
  Reactor* open(grpc::GenericCallbackServerContext* ctx) {
    const bool streaming = streaming_.count(ctx->method()) > 0;
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = ++next_id_;
    auto r = std::make_shared<Reactor>(this, ctx, id, streaming);
    calls_[id] = r;
    return r.get();
  }

  void push(Event&& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(std::move(e));
    }
    ready_.notify_one();
  }

  void closed(int64_t id) {
    std::shared_ptr<Reactor> last;  // destroyed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    if (it == calls_.end()) return;
    last = std::move(it->second);
    calls_.erase(it);
  }

 private:
  // The writer thread: each answer Python handed over, sent in the order given.
  void write_loop() {
    pthread_setname_np(pthread_self(), "grpc-writer");  // its CPU is the transport's, not a model's (profiles)
    std::deque<Answer> taken;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(write_mu_);
        write_ready_.wait(lock, [&] { return !finishes_.empty() || writing_stopped_; });
        if (finishes_.empty() && writing_stopped_) return;
        taken.swap(finishes_);
      }
      for (auto& a : taken) {
        if (auto r = find(a.id)) {
          r->Finish(grpc::Status(static_cast<grpc::StatusCode>(a.code), a.message), std::move(a.payload));
        }
      }
      taken.clear();
    }
  }

  // The call's reactor (a reference that keeps it alive), or null once gRPC is done with it.
  std::shared_ptr<Reactor> find(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    return it == calls_.end() ? nullptr : it->second;
  }

  Service service_;
  std::unique_ptr<grpc::Server> server_;
  std::unordered_set<std::string> streaming_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Event> events_;
  std::unordered_map<int64_t, std::shared_ptr<Reactor>> calls_;
  int64_t next_id_ = 0;
  bool stopped_ = false;
  std::thread writer_;
  std::mutex write_mu_;
  std::condition_variable write_ready_;
  std::deque<Answer> finishes_;
  bool writing_stopped_ = false;
};

grpc::ServerGenericBidiReactor* Service::CreateReactor(grpc::GenericCallbackServerContext* ctx) {
  Reactor* r = t_->open(ctx);
  r->Begin();
  return r;
}

void Reactor::OnReadDone(bool ok) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (!started_) {
    started_ = true;
    Event e{START, id_, ctx_->method(), std::nullopt, {}, std::nullopt};
    if (ok && !streaming_) e.payload = dump(read_);
    for (const auto& kv : ctx_->client_metadata()) {
      e.metadata.emplace_back(std::string(kv.first.data(), kv.first.size()),
                              std::string(kv.second.data(), kv.second.size()));
    }
    // seconds to the deadline as gRPC has it (no deadline: centuries; Python's Rpc reads that as none)
    e.remaining = std::chrono::duration<double>(ctx_->deadline() - std::chrono::system_clock::now()).count();
    e.arrived = monotonic_now();
    t_->push(std::move(e));
    if (!streaming_) return;  // a unary call: one request, answered by finish()
    if (!ok) {
      t_->push(Event{HALF_CLOSE, id_, {}, std::nullopt, {}, std::nullopt});
      return;
    }
  } else if (!ok) {
    t_->push(Event{HALF_CLOSE, id_, {}, std::nullopt, {}, std::nullopt});
    return;
  }
  if (ok) {
    t_->push(Event{MESSAGE, id_, {}, dump(read_), {}, std::nullopt});
    StartRead(&read_);
  }
}

void Reactor::OnWriteDone(bool ok) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  writing_ = false;
  if (!ok) {  // the stream broke (the client left): nothing more can be sent
    writes_.clear();
    if (!finished_) {
      finished_ = true;
      grpc::ServerGenericBidiReactor::Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    }
    return;
  }
  Pump();
}

void Reactor::OnCancel() {
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (finished_) return;
    if (!writing_) {
      finished_ = true;
      grpc::ServerGenericBidiReactor::Finish(grpc::Status::CANCELLED);
    } else {
      writes_.clear();
      finishing_ = true;
      status_ = grpc::Status::CANCELLED;
    }
  }
  t_->push(Event{CANCEL, id_, {}, std::nullopt, {}, std::nullopt});
}

void Reactor::OnDone() {
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    done_ = true;
  }
  Transport* t = t_;
  const int64_t id = id_;
  t->closed(id);  // may destroy this reactor: touch nothing of it after
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

// The native KServe v2 lane: a C++ gRPC server for inference.GRPCInferenceService in the serving
// process (design: serve/native_lane.py and docs/serving.md "The native KServe v2 lane").
//
// C++ owns the wire: HTTP/2, protobuf parsing, the per-request checks of the common case, batch
// formation and response building. Python touches a *batch*, never a request:
//   next_batch()  -> the queued fast requests as one padded int64 batch (the GIL is released while
//                    waiting), taken when the Python worker is free, so the batch holds every request
//                    that arrived during the previous session.run;
//   complete()    <- hidden states and embeddings of that batch; C++ cuts them per request and answers.
// Every method is raw (bytes in, bytes out). A request the fast path does not fully understand (texts,
// masks other than the default, typed contents, unknown parameters, anything invalid, bytes that do
// not parse, the other v2 methods) goes to Python as the bytes it came as (next_slow / finish_slow), where serve/kserve.py answers it exactly as on the Python port, the
// same error messages included: the rules live in one place, C++ only recognises the happy path.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "grpc_predict_v2.grpc.pb.h"

namespace py = pybind11;
using Clock = std::chrono::steady_clock;
using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;

namespace {

constexpr int HIDDEN = 0, EMBEDDINGS = 1;
constexpr int MEAN = 0, FIRST = 1;

struct Settings {  // what the fast path accepts; set by configure() from the served export
  bool fast = false;  // false: every call goes to Python
  std::string model;
  int64_t vocab = 0;
  int64_t max_length = 0;            // longest row the fast path takes
  int64_t max_rows_per_request = 0;  // limits.max_sequences_per_request
  int64_t max_request_bytes = 0;
  int64_t max_request_tokens = 0;   // rows x longest row per request; 0: no limit
  int64_t max_response_bytes = 0;   // hidden states per response
  int64_t max_queue = 0;            // fast calls waiting; more go to Python (its queue, its Overloaded)
  int64_t max_batch_rows = 32;
  int64_t max_batch_tokens = 0;  // rows x padded length per batch; 0: no limit
  int64_t pad_id = 0;
  int64_t d_model = 0;
  int default_pooling = MEAN;  // an export whose default is "none" is not fast (outputs differ)
  bool default_normalize = false;
  std::string provider;
};

struct Fast {  // one ModelInfer on the fast path
  grpc::CallbackServerContext* ctx;
  grpc::ServerUnaryReactor* reactor;
  grpc::ByteBuffer* response;
  std::string id;
  int64_t rows = 0, width = 0;  // [B, T] as sent
  std::vector<int64_t> ids;      // rows x width
  std::vector<int64_t> lengths;  // per row
  std::vector<int> outputs;      // HIDDEN / EMBEDDINGS, in the order asked
  int pooling = MEAN;
  bool normalize = false;
  Clock::time_point arrived;
};

struct Slow {  // any other call, for Python
  grpc::CallbackServerContext* ctx;
  grpc::ServerUnaryReactor* reactor;
  grpc::ByteBuffer* response;
  std::string method;
  std::string payload;
};

struct Handed {  // a batch that Python is running
  std::vector<std::unique_ptr<Fast>> calls;
  int64_t rows = 0, length = 0;
};

bool read_bool(const inference::InferParameter& p, bool* out) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam: *out = p.bool_param(); return true;
    case inference::InferParameter::kInt64Param:
      if (p.int64_param() != 0 && p.int64_param() != 1) return false;
      *out = p.int64_param() == 1;
      return true;
    case inference::InferParameter::kStringParam: {
      std::string s = p.string_param();
      for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (s == "true" || s == "1") { *out = true; return true; }
      if (s == "false" || s == "0") { *out = false; return true; }
      return false;
    }
    default: return false;
  }
}

template <typename T>
bool copy_ids(const std::string& raw, int64_t count, int64_t vocab, std::vector<int64_t>* out) {
  if (static_cast<int64_t>(raw.size()) != count * static_cast<int64_t>(sizeof(T))) return false;
  out->resize(count);
  const char* p = raw.data();
  for (int64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, p + i * sizeof(T), sizeof(T));  // little-endian hosts only (x86-64, aarch64)
    if (v < 0 || static_cast<int64_t>(v) >= vocab) return false;
    (*out)[i] = static_cast<int64_t>(v);
  }
  return true;
}

// Row lengths from a right-padded 0/1 mask (1s then 0s, at least one 1); false for anything else.
template <typename T>
bool mask_lengths(const std::string& raw, int64_t rows, int64_t width, std::vector<int64_t>* lengths) {
  if (static_cast<int64_t>(raw.size()) != rows * width * static_cast<int64_t>(sizeof(T))) return false;
  lengths->assign(rows, 0);
  const char* p = raw.data();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t n = 0;
    bool zeros = false;
    for (int64_t t = 0; t < width; ++t) {
      T v;
      std::memcpy(&v, p + (r * width + t) * sizeof(T), sizeof(T));
      if (v == 1 && !zeros) ++n;
      else if (v == 0) zeros = true;
      else return false;
    }
    if (n == 0) return false;
    (*lengths)[r] = n;
  }
  return true;
}

class Lane;

// Every method is raw (bytes in, bytes out): ModelInfer is parsed here for the fast path, and all the
// rest, unparsable bytes included, goes to Python as it came.
using RawService = GRPCInferenceService::WithRawCallbackMethod_ServerLive<
    GRPCInferenceService::WithRawCallbackMethod_ServerReady<
    GRPCInferenceService::WithRawCallbackMethod_ModelReady<
    GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
    GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
    GRPCInferenceService::WithRawCallbackMethod_ModelInfer<GRPCInferenceService::Service>>>>>>;

class Service final : public RawService {
 public:
  explicit Service(Lane* lane) : lane_(lane) {}
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                       grpc::ByteBuffer* r) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                        grpc::ByteBuffer* r) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                       grpc::ByteBuffer* r) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                           grpc::ByteBuffer* r) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                          grpc::ByteBuffer* r) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                       grpc::ByteBuffer* r) override;

 private:
  Lane* lane_;
};

class Lane {
 public:
  Lane() : service_(this) {}
  ~Lane() { stop(0.0); }

  int start(const std::string& address, int64_t max_receive_bytes) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(max_receive_bytes, INT32_MAX)));
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterService(&service_);
    {
      py::gil_scoped_release unlocked;
      server_ = builder.BuildAndStart();
    }
    if (!server_ || port == 0) throw std::runtime_error("cannot listen on " + address);
    return port;
  }

  void configure(const py::dict& s) {
    Settings next;
    next.fast = s["fast"].cast<bool>();
    next.model = s["model"].cast<std::string>();
    next.vocab = s["vocab"].cast<int64_t>();
    next.max_length = s["max_length"].cast<int64_t>();
    next.max_rows_per_request = s["max_rows_per_request"].cast<int64_t>();
    next.max_request_bytes = s["max_request_bytes"].cast<int64_t>();
    next.max_request_tokens = s["max_request_tokens"].cast<int64_t>();
    next.max_response_bytes = s["max_response_bytes"].cast<int64_t>();
    next.max_queue = s["max_queue"].cast<int64_t>();
    next.max_batch_rows = s["max_batch_rows"].cast<int64_t>();
    next.max_batch_tokens = s["max_batch_tokens"].cast<int64_t>();
    next.pad_id = s["pad_id"].cast<int64_t>();
    next.d_model = s["d_model"].cast<int64_t>();
    next.default_pooling = s["default_pooling"].cast<std::string>() == "first" ? FIRST : MEAN;
    next.default_normalize = s["default_normalize"].cast<bool>();
    next.provider = s["provider"].cast<std::string>();
    std::lock_guard<std::mutex> lock(mu_);
    settings_ = std::move(next);
  }

  // -- arrivals (gRPC's threads) -----------------------------------------------------------
  grpc::ServerUnaryReactor* infer(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* bytes,
                                  grpc::ByteBuffer* r) {
    auto* reactor = ctx->DefaultReactor();
    Settings s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_arrival_ = Clock::now();
      if (refusing_) return refuse(reactor);
      s = settings_;  // a copy: configure() may swap it (reload) meanwhile
    }
    if (!s.fast) return slow(ctx, reactor, "ModelInfer", bytes, r);
    ModelInferRequest parsed;
    grpc::ByteBuffer copy(*bytes);  // Deserialize consumes its buffer
    if (!grpc::SerializationTraits<ModelInferRequest>::Deserialize(&copy, &parsed).ok()) {
      return slow(ctx, reactor, "ModelInfer", bytes, r);  // Python names what is wrong
    }
    const ModelInferRequest* q = &parsed;
    auto call = std::make_unique<Fast>();
    if (!recognise(s, *q, call.get())) return slow(ctx, reactor, "ModelInfer", bytes, r);
    call->ctx = ctx;
    call->reactor = reactor;
    call->response = r;
    call->id = q->id();
    call->arrived = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (refusing_) return refuse(reactor);
      if (static_cast<int64_t>(fast_.size()) < s.max_queue) {
        ++in_flight_;
        fast_.push_back(std::move(call));
        call = nullptr;
      }
    }
    if (call) return slow(ctx, reactor, "ModelInfer", bytes, r);
    fast_ready_.notify_one();
    return reactor;
  }

  grpc::ServerUnaryReactor* slow(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor,
                                 const char* method, const grpc::ByteBuffer* q, grpc::ByteBuffer* r) {
    auto call = std::make_unique<Slow>();
    call->ctx = ctx;
    call->reactor = reactor;
    call->response = r;
    call->method = method;
    std::vector<grpc::Slice> slices;
    if (q->Dump(&slices).ok()) {
      for (const auto& slice : slices) call->payload.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_arrival_ = Clock::now();
      if (refusing_) return refuse(reactor);
      const int64_t waiting = static_cast<int64_t>(slow_.size());
      if (settings_.max_queue > 0 && waiting >= settings_.max_queue) {  // bounded, as the batcher's queue
        reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                     "queue full: " + std::to_string(waiting) + " requests waiting (max_queue_size=" +
                                         std::to_string(settings_.max_queue) + ")"));  // serve/batcher.py's words
        return reactor;
      }
      ++in_flight_;
      slow_.push_back(std::move(call));
    }
    slow_ready_.notify_one();
    return reactor;
  }

  // -- Python side: fast batches -----------------------------------------------------------
  // (batch id, ids int64 [B, T], lengths int64 [B], pooling int8 [B], normalize bool [B],
  //  queue seconds float64 [requests]) or None after `timeout` s with nothing queued, or once stopped.
  py::object next_batch(double timeout) {
    std::vector<std::unique_ptr<Fast>> taken;
    std::vector<std::unique_ptr<Fast>> dropped;  // cancelled or past their deadline
    int64_t rows = 0, length = 0;
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> lock(mu_);
      fast_ready_.wait_for(lock, std::chrono::duration<double>(timeout),
                           [&] { return !fast_.empty() || stopped_; });
      const auto now_system = std::chrono::system_clock::now();
      while (!fast_.empty()) {
        Fast* next = fast_.front().get();
        if (next->ctx->IsCancelled() || next->ctx->deadline() <= now_system) {
          dropped.push_back(std::move(fast_.front()));
          fast_.pop_front();
          continue;
        }
        int64_t row_max = 0;
        for (auto n : next->lengths) row_max = std::max(row_max, n);
        const int64_t new_rows = rows + next->rows, new_length = std::max(length, row_max);
        const bool fits = new_rows <= settings_.max_batch_rows &&
                          (settings_.max_batch_tokens == 0 || new_rows * new_length <= settings_.max_batch_tokens);
        if (!taken.empty() && !fits) break;
        rows = new_rows;
        length = new_length;
        taken.push_back(std::move(fast_.front()));
        fast_.pop_front();
      }
      for (auto& d : dropped) {
        d->reactor->Finish(d->ctx->IsCancelled()
                               ? grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client")
                               : grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                              "deadline exceeded while waiting for the batch"));
        --in_flight_;
      }
      if (!dropped.empty()) drained_.notify_all();
    }
    if (taken.empty()) return py::none();
    const auto now = Clock::now();
    py::array_t<int64_t> ids({rows, length});
    py::array_t<int64_t> lengths(rows);
    py::array_t<int8_t> pooling(rows);
    py::array_t<bool> normalize(rows);
    py::array_t<double> queued(static_cast<py::ssize_t>(taken.size()));
    auto* pid = ids.mutable_data();
    auto* pl = lengths.mutable_data();
    auto* pp = pooling.mutable_data();
    auto* pn = normalize.mutable_data();
    auto* pq = queued.mutable_data();
    int64_t pad;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pad = settings_.pad_id;
    }
    int64_t row = 0;
    for (size_t i = 0; i < taken.size(); ++i) {
      const Fast& c = *taken[i];
      pq[i] = std::chrono::duration<double>(now - c.arrived).count();
      for (int64_t r = 0; r < c.rows; ++r, ++row) {
        const int64_t n = c.lengths[r];
        std::memcpy(pid + row * length, c.ids.data() + r * c.width, n * sizeof(int64_t));
        std::fill(pid + row * length + n, pid + (row + 1) * length, pad);
        pl[row] = n;
        pp[row] = static_cast<int8_t>(c.pooling);
        pn[row] = c.normalize;
      }
    }
    int64_t handle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      handle = ++next_handle_;
      auto& h = handed_[handle];
      h.calls = std::move(taken);
      h.rows = rows;
      h.length = length;
    }
    return py::make_tuple(handle, ids, lengths, pooling, normalize, queued);
  }

  // Answers batch `handle` from hidden float32 [B, >=T, D] (each row read up to its own length) and
  // embeddings float32 [B, D] (pooled and normalised per row), and per row the rows and padded length
  // of the session.run that computed it. Returns the seconds from each request's arrival to its
  // answer (for the latency metric); None when a drain abandoned the batch meanwhile.
  using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
  py::object complete(int64_t handle, Floats hidden, Floats emb, py::array_t<int64_t> run_rows,
                      py::array_t<int64_t> run_length) {
    Handed batch;
    if (!take(handle, &batch)) return py::none();
    if (run_rows.size() != batch.rows || run_length.size() != batch.rows || hidden.ndim() != 3 ||
        hidden.shape(0) != batch.rows || hidden.shape(1) < batch.length || emb.ndim() != 2 ||
        emb.shape(0) != batch.rows || emb.shape(1) != hidden.shape(2)) {
      fail_all(&batch, grpc::StatusCode::INTERNAL, "native lane: outputs do not match the batch");
      throw std::invalid_argument("complete(): outputs do not match the batch");
    }
    const float* hd = hidden.data();
    const float* ed = emb.data();
    const int64_t hidden_width = hidden.shape(1), d = hidden.shape(2);
    const int64_t* rr = run_rows.data();
    const int64_t* rl = run_length.data();
    std::string provider, model;
    {
      std::lock_guard<std::mutex> lock(mu_);
      provider = settings_.provider;
      model = settings_.model;
    }
    py::array_t<double> seconds(static_cast<py::ssize_t>(batch.calls.size()));
    double* ps = seconds.mutable_data();
    {
      py::gil_scoped_release unlocked;
      int64_t row = 0;
      size_t index = 0;
      for (auto& call : batch.calls) {
        Fast& c = *call;
        ModelInferResponse out;
        out.set_model_name(model);
        out.set_model_version("1");
        out.set_id(c.id);
        for (int which : c.outputs) {
          auto* tensor = out.add_outputs();
          tensor->set_datatype("FP32");
          std::string* raw = out.add_raw_output_contents();
          if (which == HIDDEN) {
            tensor->set_name("last_hidden_state");
            tensor->add_shape(c.rows);
            tensor->add_shape(c.width);
            tensor->add_shape(d);
            raw->assign(static_cast<size_t>(c.rows * c.width * d) * sizeof(float), '\0');
            for (int64_t r = 0; r < c.rows; ++r) {
              std::memcpy(&(*raw)[static_cast<size_t>(r * c.width * d) * sizeof(float)],
                          hd + (row + r) * hidden_width * d, static_cast<size_t>(c.lengths[r] * d) * sizeof(float));
            }
          } else {
            tensor->set_name("embeddings");
            tensor->add_shape(c.rows);
            tensor->add_shape(d);
            raw->assign(reinterpret_cast<const char*>(ed + row * d), static_cast<size_t>(c.rows * d) * sizeof(float));
          }
        }
        // the run that computed the request's longest row (as the Python path reports it)
        int64_t longest = row;
        for (int64_t r = 0; r < c.rows; ++r) {
          if (c.lengths[r] > c.lengths[longest - row]) longest = row + r;
        }
        auto& params = *out.mutable_parameters();
        params["batch_size"].set_int64_param(rr[longest]);
        params["batch_sequence_length"].set_int64_param(rl[longest]);
        params["execution_provider"].set_string_param(provider);
        bool own = false;
        const bool ok = grpc::SerializationTraits<ModelInferResponse>::Serialize(out, c.response, &own).ok();
        ps[index++] = std::chrono::duration<double>(Clock::now() - c.arrived).count();
        c.reactor->Finish(ok ? grpc::Status::OK
                             : grpc::Status(grpc::StatusCode::INTERNAL, "native lane: response not serialised"));
        row += c.rows;
      }
      answered(static_cast<int64_t>(batch.calls.size()));
    }
    return seconds;
  }

  void fail(int64_t handle, int code, const std::string& message) {
    Handed batch;
    if (take(handle, &batch)) fail_all(&batch, static_cast<grpc::StatusCode>(code), message);
  }

  // -- Python side: everything else --------------------------------------------------------
  // (handle, method, request bytes, seconds left or None) or None after `timeout` / once stopped.
  py::object next_slow(double timeout) {
    std::unique_ptr<Slow> call;
    int64_t handle = 0;
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> lock(mu_);
      slow_ready_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return !slow_.empty() || stopped_; });
      if (!slow_.empty()) {
        call = std::move(slow_.front());
        slow_.pop_front();
        handle = ++next_handle_;
      }
    }
    if (!call) return py::none();  // with the GIL again
    const auto deadline = call->ctx->deadline();
    py::object remaining = py::none();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      const double s = std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count();
      if (s < 10.0 * 365 * 86400) remaining = py::float_(s);
    }
    py::bytes payload(call->payload);
    py::str method(call->method);
    {
      std::lock_guard<std::mutex> lock(mu_);
      slow_handed_[handle] = std::move(call);
    }
    return py::make_tuple(handle, method, payload, remaining);
  }

  // code 0: `payload` is the serialised response; otherwise the call fails with (code, message).
  void finish_slow(int64_t handle, int code, const std::string& message, const std::string& payload) {
    std::unique_ptr<Slow> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = slow_handed_.find(handle);
      if (it == slow_handed_.end()) return;  // abandoned by a drain
      call = std::move(it->second);
      slow_handed_.erase(it);
    }
    grpc::Status status = grpc::Status::OK;
    if (code != 0) {
      status = grpc::Status(static_cast<grpc::StatusCode>(code), message);
    } else {
      grpc::Slice slice(payload.data(), payload.size());
      *call->response = grpc::ByteBuffer(&slice, 1);
    }
    call->reactor->Finish(status);
    answered(1);
  }

  // -- drain -------------------------------------------------------------------------------
  // New calls get UNAVAILABLE `message`; waits up to `timeout` s for the admitted ones to be
  // answered; True when they all were.
  bool drain(const std::string& message, double timeout) {
    py::gil_scoped_release unlocked;
    std::unique_lock<std::mutex> lock(mu_);
    refusing_ = true;
    refusal_ = message;
    return drained_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return in_flight_ == 0; });
  }

  // Waits until no call has arrived for `quiet` s, or for `timeout` s at most: stop() cancels what
  // gRPC holds unanswered, so the listener closes only once callers have stopped coming (the calls
  // arriving meanwhile are refused UNAVAILABLE), as serve/app.py's drain_quiet_ms on the main port.
  void wait_quiet(double quiet, double timeout) {
    py::gil_scoped_release unlocked;
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
    const auto gap = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(quiet));
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      const auto wake = std::min(last_arrival_ + gap, until);
      if (Clock::now() >= wake) return;
      drained_.wait_until(lock, wake);
    }
  }

  // Answers every call not yet answered with UNAVAILABLE `message`; the number of them.
  int64_t abandon(const std::string& message) {
    py::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> lock(mu_);
    return finish_all_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE, message));
  }

  int64_t in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }

  int64_t queued() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(fast_.size() + slow_.size());
  }

  // Closes the listener and the connections (after drain + abandon: nothing is left to cancel).
  void stop(double grace) {
    std::unique_ptr<grpc::Server> server;
    {
      std::lock_guard<std::mutex> lock(mu_);
      refusing_ = true;
      stopped_ = true;
      server = std::move(server_);
    }
    fast_ready_.notify_all();
    slow_ready_.notify_all();
    if (server) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        finish_all_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server stopped"));
      }
      py::gil_scoped_release unlocked;
      server->Shutdown(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(grace * 1e6)));
      server->Wait();
    }
  }

 private:
  grpc::ServerUnaryReactor* refuse(grpc::ServerUnaryReactor* reactor) {  // mu_ held
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, refusal_));
    return reactor;
  }

  // Answers every call queued or handed to Python with `status` (mu_ held); the number of them.
  int64_t finish_all_locked(const grpc::Status& status) {
    int64_t n = 0;
    for (auto& c : fast_) { c->reactor->Finish(status); ++n; }
    for (auto& c : slow_) { c->reactor->Finish(status); ++n; }
    for (auto& [h, batch] : handed_) for (auto& c : batch.calls) { c->reactor->Finish(status); ++n; }
    for (auto& [h, c] : slow_handed_) { c->reactor->Finish(status); ++n; }
    fast_.clear();
    slow_.clear();
    handed_.clear();
    slow_handed_.clear();
    in_flight_ -= n;
    drained_.notify_all();
    return n;
  }

  void answered(int64_t n) {  // n calls finished: what a drain waits for
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ -= n;
    drained_.notify_all();
  }

  bool take(int64_t handle, Handed* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_.find(handle);
    if (it == handed_.end()) return false;
    *out = std::move(it->second);
    handed_.erase(it);
    return true;
  }

  void fail_all(Handed* batch, grpc::StatusCode code, const std::string& message) {
    for (auto& c : batch->calls) c->reactor->Finish(grpc::Status(code, message));
    answered(static_cast<int64_t>(batch->calls.size()));
  }

  // The happy path of serve/kserve.py's request_from_v2, recognised without error messages: any
  // doubt (or any error) returns false and the call goes to Python, which says what is wrong.
  bool recognise(const Settings& s, const ModelInferRequest& q, Fast* call) {
    if (q.model_name() != s.model) return false;
    if (!q.model_version().empty() && q.model_version() != "1") return false;
    if (q.ByteSizeLong() > static_cast<size_t>(s.max_request_bytes)) return false;
    const int n = q.inputs_size();
    if (n < 1 || n > 2 || q.raw_input_contents_size() != n) return false;  // typed contents: Python
    int ids_at = -1, mask_at = -1;
    for (int i = 0; i < n; ++i) {
      const auto& t = q.inputs(i);
      if (t.has_contents()) return false;
      if (t.name() == "input_ids" && ids_at < 0) ids_at = i;
      else if (t.name() == "attention_mask" && mask_at < 0) mask_at = i;
      else return false;
      if (t.shape_size() != 2 || (t.datatype() != "INT64" && t.datatype() != "INT32")) return false;
    }
    if (ids_at < 0) return false;
    const auto& it = q.inputs(ids_at);
    const int64_t rows = it.shape(0), width = it.shape(1);
    if (rows < 1 || width < 1 || rows > s.max_rows_per_request) return false;
    if (mask_at >= 0 && (q.inputs(mask_at).shape(0) != rows || q.inputs(mask_at).shape(1) != width)) return false;
    const bool ids32 = it.datatype() == "INT32";
    if (!(ids32 ? copy_ids<int32_t>(q.raw_input_contents(ids_at), rows * width, s.vocab, &call->ids)
                : copy_ids<int64_t>(q.raw_input_contents(ids_at), rows * width, s.vocab, &call->ids))) {
      return false;
    }
    if (mask_at >= 0) {
      const auto& raw = q.raw_input_contents(mask_at);
      const bool ok = q.inputs(mask_at).datatype() == "INT32" ? mask_lengths<int32_t>(raw, rows, width, &call->lengths)
                                                               : mask_lengths<int64_t>(raw, rows, width, &call->lengths);
      if (!ok) return false;
    } else {
      call->lengths.assign(rows, width);
    }
    int64_t longest = 0, tokens = 0;
    for (auto len : call->lengths) {
      if (len > s.max_length) return false;
      longest = std::max(longest, len);
      tokens += len;
    }
    if (s.max_request_tokens && rows * longest > s.max_request_tokens) return false;
    call->pooling = s.default_pooling;
    call->normalize = s.default_normalize;
    for (const auto& [name, value] : q.parameters()) {
      if (name == "pooling") {
        if (value.parameter_choice_case() != inference::InferParameter::kStringParam) return false;
        if (value.string_param() == "mean") call->pooling = MEAN;
        else if (value.string_param() == "first") call->pooling = FIRST;
        else return false;
      } else if (name == "normalize") {
        if (!read_bool(value, &call->normalize)) return false;
      } else {
        return false;  // mask parameters and anything unknown: Python
      }
    }
    if (q.outputs_size() == 0) {
      call->outputs = {HIDDEN, EMBEDDINGS};
    } else {
      bool seen[2] = {false, false};
      for (const auto& o : q.outputs()) {
        const int which = o.name() == "last_hidden_state" ? HIDDEN : o.name() == "embeddings" ? EMBEDDINGS : -1;
        if (which < 0 || seen[which]) return false;
        seen[which] = true;
        call->outputs.push_back(which);
      }
    }
    for (int which : call->outputs) {
      if (which == HIDDEN && tokens * s.d_model * 4 > s.max_response_bytes) return false;
    }
    call->rows = rows;
    call->width = width;
    return true;
  }

  Service service_;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mu_;
  std::condition_variable fast_ready_, slow_ready_, drained_;
  std::deque<std::unique_ptr<Fast>> fast_;
  std::deque<std::unique_ptr<Slow>> slow_;
  std::unordered_map<int64_t, Handed> handed_;
  std::unordered_map<int64_t, std::unique_ptr<Slow>> slow_handed_;
  Settings settings_;
  std::string refusal_ = "server is shutting down";
  int64_t next_handle_ = 0;
  Clock::time_point last_arrival_ = Clock::time_point::min();
  int64_t in_flight_ = 0;
  bool refusing_ = false;
  bool stopped_ = false;
};

// The other v2 methods go to Python whole.
#define LANE_SLOW_METHOD(NAME)                                                                     \
  grpc::ServerUnaryReactor* Service::NAME(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q, \
                                          grpc::ByteBuffer* r) {                                      \
    return lane_->slow(c, c->DefaultReactor(), #NAME, q, r);                                          \
  }
LANE_SLOW_METHOD(ServerLive)
LANE_SLOW_METHOD(ServerReady)
LANE_SLOW_METHOD(ModelReady)
LANE_SLOW_METHOD(ServerMetadata)
LANE_SLOW_METHOD(ModelMetadata)
#undef LANE_SLOW_METHOD

grpc::ServerUnaryReactor* Service::ModelInfer(grpc::CallbackServerContext* c, const grpc::ByteBuffer* q,
                                              grpc::ByteBuffer* r) {
  return lane_->infer(c, q, r);
}

}  // namespace

PYBIND11_MODULE(_kserve_lane, m) {
  m.doc() = "The native KServe v2 lane (native/kserve_lane.cc; used by serve/native_lane.py)";
  py::class_<Lane>(m, "Lane")
      .def(py::init<>())
      .def("start", &Lane::start, py::arg("address"), py::arg("max_receive_bytes"))
      .def("configure", &Lane::configure)
      .def("next_batch", &Lane::next_batch, py::arg("timeout"))
      .def("complete", &Lane::complete)
      .def("fail", &Lane::fail)
      .def("next_slow", &Lane::next_slow, py::arg("timeout"))
      .def("finish_slow", &Lane::finish_slow, py::arg("handle"), py::arg("code"), py::arg("message"),
           py::arg("payload"))
      .def("drain", &Lane::drain)
      .def("abandon", &Lane::abandon)
      .def("wait_quiet", &Lane::wait_quiet, py::arg("quiet"), py::arg("timeout"))
      .def("in_flight", &Lane::in_flight)
      .def("queued", &Lane::queued)
      .def("stop", &Lane::stop, py::arg("grace"));
}

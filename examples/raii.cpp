// raii: xcall from C++ with its handles owned by RAII types and its errors
// as exceptions.
//
//   raii
//
// A few lines of wrapper give C++ callers what the C ABI leaves to them:
// every handle freed exactly once (std::unique_ptr with xcall's free
// function), every failed call turned into an exception carrying xcall's
// message, and a lambda as the graph cache's record function.
#include <xcall.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace xc {

// A failed xcall call: its status and xcall's message for this thread.
class Error : public std::runtime_error {
 public:
  explicit Error(xcall_status status)
      : std::runtime_error(std::string(xcall_status_name(status)) + ": " + xcall_last_error_message()),
        status_(status) {}
  xcall_status status() const { return status_; }

 private:
  xcall_status status_;
};

inline void check(xcall_status status) {
  if (status != XCALL_STATUS_OK) throw Error(status);
}

inline std::uint64_t digest(const std::string& text, std::uint64_t seed = 0) {
  std::uint64_t out = 0;
  check(xcall_digest(text.data(), text.size(), seed, &out));
  return out;
}

// Owns one xcall_graph_cache.
class GraphCache {
 public:
  GraphCache() {
    xcall_graph_cache* raw = nullptr;
    check(xcall_graph_cache_new(nullptr, &raw));
    cache_.reset(raw);
  }

  // Runs `work(stream)` as the call `call` through the cache; `work`
  // returns an xcall_status. Returns the xcall_graph_outcome.
  template <class Work>
  std::uint32_t execute(const xcall_call& call, Work& work) {
    std::uint32_t outcome = 0;
    check(xcall_graph_cache_execute(cache_.get(), &call, &GraphCache::trampoline<Work>, &work, &outcome));
    return outcome;
  }

  xcall_graph_stats stats(const xcall_target& where) const {
    xcall_graph_stats s{};
    check(xcall_graph_cache_stats(cache_.get(), &where, &s));
    return s;
  }

 private:
  template <class Work>
  static std::uint32_t trampoline(void* user_data, void* stream) {
    // No exception may cross into xcall: report it as a failed record.
    try {
      return (*static_cast<Work*>(user_data))(stream);
    } catch (...) {
      return XCALL_STATUS_CALLBACK_FAILED;
    }
  }
  struct Free {
    void operator()(xcall_graph_cache* c) const { xcall_graph_cache_free(c); }
  };
  std::unique_ptr<xcall_graph_cache, Free> cache_;
};

}  // namespace xc

int main() {
  try {
    const xcall_target host{XCALL_PLATFORM_HOST, 0, nullptr};
    std::vector<float> in(1024), out(1024, -1.0f);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.5f;

    xc::GraphCache cache;
    const float scale = 3.0f;
    auto work = [&](void* /*stream: NULL on Host*/) -> std::uint32_t {
      for (std::size_t i = 0; i < in.size(); ++i) out[i] = in[i] * scale;
      return XCALL_STATUS_OK;
    };
    const std::uint64_t bytes = in.size() * sizeof(float);
    const xcall_buffer buffers[2] = {
        {reinterpret_cast<std::uint64_t>(in.data()), bytes, XCALL_BUFFER_ROLE_IN},
        {reinterpret_cast<std::uint64_t>(out.data()), bytes, XCALL_BUFFER_ROLE_OUT}};
    const xcall_call call{host, xc::digest("example.scale"), xc::digest("scale=3"), buffers, 2, 0};
    cache.execute(call, work);
    bool right = true;
    for (std::size_t i = 0; i < in.size(); ++i) right = right && out[i] == in[i] * scale;
    std::printf("scale through the graph cache: %s (%llu run(s) on Host)\n", right ? "right" : "WRONG",
                static_cast<unsigned long long>(cache.stats(host).eager_host));

    // A bad call becomes an exception with xcall's message; nothing leaks.
    const xcall_call no_buffers{host, 1, 2, nullptr, 0, 0};
    try {
      cache.execute(no_buffers, work);
      std::printf("a call without buffers was accepted\n");
      return 1;
    } catch (const xc::Error& e) {
      std::printf("refused as expected: %s\n", e.what());
      if (e.status() != XCALL_STATUS_INVALID_ARGUMENT && e.status() != XCALL_STATUS_NULL_ARGUMENT) return 1;
    }
    return right ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "raii: %s\n", e.what());
    return 1;
  }
}

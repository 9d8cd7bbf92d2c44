// kvscope's CPU kernels: a decode step's matmuls over quantized weights and its attention over any KV layout.
//
// Every result row is computed by one thread with one fixed order of operations, whatever the number of rows,
// the batch, the thread count, the cache layout or its block size: the kernels are batch-invariant by
// construction. Built at first use by torch.utils.cpp_extension (engine/kernels/__init__.py) with the host's
// instruction set; the AVX2 paths are used where the compiler targets AVX2 (the weight kernels' AVX-512 ones where
// it targets AVX-512 with VNNI), a scalar path elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#endif

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVSCOPE_AVX2 1
#define KVSCOPE_INT_DOTS true  // int4 / int8 KV attention by integer dot products (else through floats)
#else
#define KVSCOPE_INT_DOTS false
#endif
#if defined(KVSCOPE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSCOPE_AVX512 1  // the weight kernels take two blocks of 32 a 512-bit instruction
#endif

namespace {

constexpr int64_t QK = 32;  // weights come in blocks of 32 (GGUF's), activations are read a block or a pair at a time

#ifdef __F16C__
inline float half_to_float(uint16_t bits) { return _cvtsh_ss(bits); }
#else
inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }
#endif

// ---------------------------------------------------------------- activations -> int16, one scale a row
// A row of activations becomes x ~ d * q with d = amax / 32767 and q = round(x / d), 15 bits for every value
// (measured against float32 weights on real text: mean KL 1e-6 nats; one int8 per block of 32 measured 0.003).
// One scale a row leaves a block's dot product one multiply by the weight's scale (the row's d comes last), and
// int16 codes take one vpdpwssd / pmaddwd per 32 products. The codes are kept in pair order: within every 64
// values [0-15, 32-47, 16-31, 48-63], so that one register holds the first halves of blocks b and b+1 and the
// next one their second halves (a trailing block alone keeps its order). q [M, K]; d [M]; s [M, K/32] = the sum of
// each block's codes (the int4 minimums multiply it: the codes' rounding then cancels as it does in w = code * scale + min).
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> d, s;
};

constexpr float CODE_MAX = 32767.f;

// where half h (0: values 0-15, 1: values 16-31) of block b starts in a row of pair-ordered codes (nb blocks)
inline int64_t half_at(int64_t b, int h, int64_t nb) {
  if (b == nb - 1 && nb % 2) return b * QK + h * 16;
  return (b / 2) * 2 * QK + h * QK + (b % 2) * 16;
}

inline float row_amax(const float* x, int64_t k) {
  int64_t j = 0;
  float amax = 0.f;
#ifdef KVSCOPE_AVX512
  __m512 m = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
  amax = _mm512_reduce_max_ps(m);
#endif
  for (; j < k; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}

// 16 values -> their codes (round to nearest even, as std::nearbyint); returns the codes' sum
inline int quantize16(const float* x, float inv, int16_t* q) {
#ifdef KVSCOPE_AVX512
  __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inv));
  v = _mm512_min_ps(_mm512_set1_ps(CODE_MAX), _mm512_max_ps(_mm512_set1_ps(-CODE_MAX), v));
  __m512i codes = _mm512_cvtps_epi32(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(codes));
  return _mm512_reduce_add_epi32(codes);
#else
  int sum = 0;
  for (int j = 0; j < 16; ++j)
    sum += q[j] = static_cast<int16_t>(std::min(CODE_MAX, std::max(-CODE_MAX, std::nearbyint(x[j] * inv))));
  return sum;
#endif
}

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k) {
  QuantizedRows r;
  int64_t nb = k / QK;
  r.q.resize(m * k);
  r.d.resize(m);
  r.s.resize(m * nb);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    float amax = row_amax(row, k);
    r.d[i] = amax / CODE_MAX;
    float inv = amax > 0.f ? CODE_MAX / amax : 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float* block = row + b * QK;
      int sum = 0;
      for (int h = 0; h < 2; ++h) sum += quantize16(block + h * 16, inv, r.q.data() + i * k + half_at(b, h, nb));
      r.s[i * nb + b] = static_cast<float>(sum);  // exact: |sum| <= 32 * 32767 < 2^24
    }
  }
  return r;
}

// per activation row and weight group: the sum of its activation codes (exact in float: |sum| < 2^24 for
// groups of up to 256) -> [m, groups]
std::vector<float> group_sums(const QuantizedRows& rows, int64_t m, int64_t k, int64_t groups) {
  std::vector<float> xsg(m * groups, 0.f);
  int64_t nb = k / QK, sub = nb / groups;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < nb; ++b) xsg[i * groups + b / sub] += rows.s[i * nb + b];
  return xsg;
}

#ifdef KVSCOPE_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

#endif

// a job of n items in about two chunks a thread, each at least `least` items: four a thread (projections) or one
// task each (attention) measured 3-9% slower steps at two threads, alternating in one process (each chunk's claim,
// its cold start and the last one's wait cost more than the balance they bought; in longer chunks one thread reads
// a head's key tiles in order, its prefetches for the next tile its own). The attention's tasks taper instead
// (parallel_tapered, below).
int64_t two_a_thread(int64_t n, int64_t least) {
  return std::max<int64_t>(least, n / (2 * std::max(1, at::get_num_threads())));
}
int64_t grain_for(int64_t n) { return two_a_thread(n, 64); }  // a projection's weight rows

// ---------------------------------------------------------------- the kernels' threads
// A job is split into chunks that the caller and the pool's workers claim one at a time, and the caller waits only
// for chunks that were claimed: a worker the system has descheduled (another process, the server's event loop, a
// browser beside the app) holds up at most the chunk it took, where an OpenMP region waits at its barrier for
// every thread to be scheduled again (2 threads, 512 tokens, a busy process pinned to the other core of a 2-core
// Xeon: 14.5-24 ms steps with OpenMP, 9.3-9.9 ms with this pool). A chunk is computed by one thread, whichever
// claims it, in the same order, so the results do not depend on the claims or the thread count.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class ChunkPool {
 public:
  static ChunkPool& instance() {
    static ChunkPool* pool = new ChunkPool();  // never destroyed: its threads may outlive static destructors
    return *pool;
  }

  // f(c) for every c in [0, chunks), on up to `threads` threads (this one included)
  template <typename F>
  void run(int64_t chunks, int64_t threads, const F& f) {
    std::unique_lock<std::mutex> caller(callers_, std::defer_lock);
    if (inside_ || chunks > CHUNK_MASK || !caller.try_lock()) {  // nested, or another thread's job runs: alone
      for (int64_t c = 0; c < chunks; ++c) f(c);
      return;
    }
    start_workers(threads - 1);
    task_ = [](const void* fn, int64_t c) { (*static_cast<const F*>(fn))(c); };
    fn_ = &f;
    done_.store(0);
    job_ = (job_ + 1) & JOB_MASK;
    claim_.store((job_ << 48) | (static_cast<uint64_t>(chunks) << 24));
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(wake_);
      wakeup_.notify_all();
    }
    work();
    while (done_.load() < chunks) cpu_relax();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  static constexpr uint64_t CHUNK_MASK = (1ull << 24) - 1, JOB_MASK = (1ull << 16) - 1;
  static constexpr int SPINS = 4000;  // yields between a step's jobs (~0.7 ms on the Xeon), then a worker sleeps
  static thread_local bool inside_;

  // claim and run chunks of the current job until none is left; claim_ = job << 48 | chunks << 24 | next
  void work() {
    inside_ = true;
    for (uint64_t c = claim_.load();;) {
      if ((c & CHUNK_MASK) >= ((c >> 24) & CHUNK_MASK)) break;
      if (!claim_.compare_exchange_weak(c, c + 1)) continue;
      try {
        task_(fn_, static_cast<int64_t>(c & CHUNK_MASK));  // the job cannot end before this chunk is done
      } catch (...) {
        std::lock_guard<std::mutex> lock(wake_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1);
      c = claim_.load();
    }
    inside_ = false;
  }

  void start_workers(int64_t wanted) {
    wanted_.store(wanted);
    while (static_cast<int64_t>(started_) < wanted) {
      std::thread worker([this, i = started_++] { serve(i); });
#ifdef __linux__
      pthread_setname_np(worker.native_handle(), "kvscope-pool");  // (top -H, perf and the scheduler's tools name it)
#endif
      worker.detach();
    }
  }

  void serve(int64_t index) {
    uint64_t seen = claim_.load() >> 48;
    for (;;) {
      uint64_t job = wait_for_job(seen);
      seen = job;
      if (index < wanted_.load()) work();
    }
  }

  // Between jobs a worker yields its core instead of spinning on it: a thread woken meanwhile (the server's event
  // loop, its clients, the app's window) runs at once rather than after the worker's time slice. `serve` on the
  // model-167 Xeon, three A/B runs of 10-14 rounds: one client's tok/s +6-8%, p99 at 4 clients 5-12% lower; the
  // same SPINS of pauses (~45 us here) or 16x as many (as long as the yields) gave no such gain; steps alone the same.
  uint64_t wait_for_job(uint64_t seen) {
    for (int i = 0; i < SPINS; ++i) {
      uint64_t job = claim_.load() >> 48;
      if (job != seen) return job;
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(wake_);
    sleeping_.fetch_add(1);
    wakeup_.wait(lock, [&] { return (claim_.load() >> 48) != seen; });
    sleeping_.fetch_sub(1);
    return claim_.load() >> 48;
  }

  std::mutex callers_, wake_;
  std::condition_variable wakeup_;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0}, sleeping_{0}, wanted_{0};
  uint64_t job_ = 0;
  int64_t started_ = 0;
  void (*task_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  std::exception_ptr error_;  // the first exception a chunk threw, rethrown on the caller's thread
};
thread_local bool ChunkPool::inside_ = false;

// f(i0, i1) over [0, n) in chunks of `grain`, on the pool (torch's thread count)
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  int64_t chunks = (n + grain - 1) / grain, threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) return f(0, n);
  ChunkPool::instance().run(chunks, threads, [&](int64_t c) { f(c * grain, std::min(n, (c + 1) * grain)); });
}

// f(i0, i1) over [0, n) in chunks that taper: each a (2 x threads)-th of the items left, down to one, so the first
// chunks stay long (a thread reads a head's tiles in order) and the last leave little for the others to wait on. The
// attention's tasks: with two_a_thread's equal chunks the caller waited for the last one 0.2 ms of a bfloat16 step at
// 4,096 tokens on two threads and 0.8 ms of an int8 one (the pause loop's samples, Xeon); tapered, whole steps on two
// threads took 0.95-1.005x the time (0.975x on average) at 4,096 and 512 tokens in four alternating runs over the
// three precisions, 0.994-1.015x (noise) at 2,048 (tapering the projections' chunks too measured no better)
template <typename F>
void parallel_tapered(int64_t n, const F& f) {
  int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) return f(0, n);
  c10::SmallVector<int64_t, 64> start{0};
  while (start.back() < n) start.push_back(start.back() + std::max<int64_t>(1, (n - start.back()) / (2 * threads)));
  ChunkPool::instance().run(static_cast<int64_t>(start.size()) - 1, threads,
                            [&](int64_t c) { f(start[c], start[c + 1]); });
}

// ---------------------------------------------------------------- a decode step's tensors
// A layer's outputs (projections, norms, rotary, attention) are 11 tensors; at::empty and the tensor's release
// cost ~0.6-1 us each on the Xeon (a loop of 20,000), and fresh memory is cold: taken from the arena, the cycles a
// two-thread step spends between the pool's jobs went from 3.6-4.0 to ~2.8 million (int4 KV, 4,096 tokens, rdtsc).
// Inside decoder_layers a layer takes them from a StepArena instead: the same slots layer after layer (two sets,
// alternating, since a layer's last output is the next layer's input), each handed out again only where nothing
// else holds the tensor or a view of its storage, else replaced by a fresh one. Elsewhere (an op called from
// Python) fresh_tensor is at::empty.
class StepArena {
 public:
  static StepArena*& active() {
    thread_local StepArena* arena = nullptr;
    return arena;
  }

  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions& options) {
    if (next_ == slots_.size()) slots_.emplace_back();
    at::Tensor& slot = slots_[next_++];
    if (!slot.defined() || slot.use_count() != 1 || slot.storage().use_count() != 1 || slot.sizes() != sizes ||
        slot.dtype() != options.dtype())
      slot = at::empty(sizes, options);
    return slot;
  }

  void restart() { next_ = 0; }

 private:
  std::vector<at::Tensor> slots_;
  size_t next_ = 0;
};

// the arenas of a thread's decode steps, two sets alternating by layer; active while in scope
class ArenaScope {
 public:
  ArenaScope() : before_(StepArena::active()) {}
  ~ArenaScope() { StepArena::active() = before_; }
  void layer(size_t i) {
    StepArena& arena = sets()[i % 2];
    arena.restart();
    StepArena::active() = &arena;
  }

 private:
  static std::array<StepArena, 2>& sets() {
    thread_local std::array<StepArena, 2> both;
    return both;
  }
  StepArena* before_;
};

at::Tensor fresh_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  StepArena* arena = StepArena::active();
  return arena ? arena->take(sizes, options) : at::empty(sizes, options);
}

// a projection's input x: [..., K] float32, contiguous, read as M rows of K; its output is allocated as [..., N]
// in one call (views of either went through the dispatcher: ~700 of the ~4,400 cycles a one-row projection spent
// outside its job, rdtsc on the Xeon)
struct InputRows {
  const float* data;
  int64_t m;
  at::Tensor output;  // [..., N], uninitialised
};

InputRows as_rows(const at::Tensor& x, int64_t k, int64_t n) {
  TORCH_CHECK(k > 0 && x.dim() >= 1 && x.size(-1) == k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [..., K] with K > 0 the weight's input size");
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  return {x.data_ptr<float>(), x.numel() / k, fresh_tensor(sizes, x.options())};
}

// ---------------------------------------------------------------- quantized weights, one row at a time
// A weight row is read once, as one stream (prefetched ahead), and multiplied with every activation row; each
// output y[m, n] accumulates its blocks in block order in its own accumulator, so it never depends on M.
constexpr int64_t MAX_ROWS = 16;  // activation rows a row-at-a-time kernel takes (the 16-row layout's: any)
constexpr int64_t PREFETCH = 2048;  // bytes ahead of the weight row being read

// f(std::integral_constant<int, M>) with M = m where a kernel is compiled for that many activation rows (their
// accumulators stay in registers), else M = 0 (any m): the same operations per row either way, so the same bits
template <typename F>
inline void with_rows(int64_t m, F f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

constexpr int64_t SPAN_BYTES = 256 << 10;  // the weights a span of a job holds: a later group of rows finds them in L2
constexpr int64_t ROW_GROUP = 8;  // activation rows a kernel call takes at most (with_rows compiles 1 to 8)

// f(r0, std::integral_constant<int, M>, u0, u1) for the activation rows [r0, r0 + M) of m, in groups of 8 and what
// is left (1 to 7): every group a compiled row count, each row computed alone within its group (so the same bits
// for any m). Each group reads the weights again: 5 rows as 4 + 1 took 1.66x the int8 head's time of one 5-row
// group. So where m takes two groups, a job's weight units [w0, w1) (unit_bytes each) go in spans of SPAN_BYTES,
// every group over one span before the next, and the later group reads the span from L2 (16 rows: 0.95x).
template <typename F>
inline void in_row_groups(int64_t m, int64_t w0, int64_t w1, int64_t unit_bytes, F f) {
  int64_t span = m <= ROW_GROUP ? w1 - w0 : std::max<int64_t>(1, SPAN_BYTES / unit_bytes);
  for (int64_t u0 = w0; u0 < w1; u0 += span)
    for (int64_t r0 = 0; r0 < m;) {
      int64_t take = std::min<int64_t>(m - r0, ROW_GROUP);
      with_rows(take, [&](auto rows_m) {
        if constexpr (decltype(rows_m)::value > 0) f(r0, rows_m, u0, std::min(w1, u0 + span));
      });
      r0 += take;
    }
}

// the start of the cache line that holds p
inline const char* line_of(const void* p) {
  return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
}

// the lines of [from, to) into L1 (hint _MM_HINT_T0) or L2
inline void prefetch_span(const void* from, const void* to, int hint) {
#ifdef KVSCOPE_AVX2
  for (const char* p = line_of(from); p < static_cast<const char*>(to); p += 64)
    hint == _MM_HINT_T0 ? _mm_prefetch(p, _MM_HINT_T0) : _mm_prefetch(p, _MM_HINT_T1);
#endif
}

// out[i] = first + i * stride for i < n (a run of rows' addresses), eight a store where AVX-512 is built
template <typename T>
inline void fill_addresses(const T* first, int64_t stride, int64_t n, const T** out) {
#ifdef __AVX512F__
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(T)), start = reinterpret_cast<int64_t>(first);
  __m512i at = _mm512_setr_epi64(start, start + bytes, start + 2 * bytes, start + 3 * bytes, start + 4 * bytes,
                                 start + 5 * bytes, start + 6 * bytes, start + 7 * bytes);
  const __m512i step = _mm512_set1_epi64(8 * bytes);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8, at = _mm512_add_epi64(at, step)) _mm512_storeu_si512(out + i, at);
  if (i < n) _mm512_mask_storeu_epi64(out + i, static_cast<__mmask8>((1u << (n - i)) - 1), at);
#else
  for (int64_t i = 0; i < n; ++i) out[i] = first + i * stride;
#endif
}

// the float16 scales and minimums of weight row `row`, a few rows ahead of the one being read (their streams
// are separate from the codes')
constexpr int64_t PARAMS_AHEAD = 16;
inline void prefetch_params(const uint16_t* scales, const uint16_t* minimums, int64_t row, int64_t groups, int64_t n) {
  if (row >= n) return;
  prefetch_span(scales + row * groups, scales + (row + 1) * groups, _MM_HINT_T0);
  if (minimums) prefetch_span(minimums + row * groups, minimums + (row + 1) * groups, _MM_HINT_T0);
}

#ifdef KVSCOPE_AVX2
// 8 float16 at p as floats
inline __m256 halves8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// float16 row -> float32 (scales, minimums of one weight row)
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t j = 0;
#ifdef KVSCOPE_AVX2
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
  for (; j < n; ++j) dst[j] = half_to_float(src[j]);
}

// float32 row -> float16, rounded to nearest even as c10::Half rounds: 8 at a time by F16C where built, instead of
// c10::Half's conversion a value at a time (an int4 window's new rows, a float16 store's)
inline void floats_to_halves(const float* src, c10::Half* dst, int64_t n) {
  int64_t j = 0;
#ifdef KVSCOPE_AVX2
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; j < n; ++j) dst[j] = c10::Half(src[j]);
}

// a row of n floats into a row of keys or values as stored (float32, bfloat16 or float16)
template <typename T>
inline void put_row(const float* src, int64_t n, T* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
}
inline void put_row(const float* src, int64_t n, c10::Half* dst) { floats_to_halves(src, dst, n); }
inline void put_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }

// a full-precision window's row (float16 or float32) -> n floats (exact either way)
inline void row_to_floats(const c10::Half* src, int64_t n, float* dst) {
  halves_to_floats(reinterpret_cast<const uint16_t*>(src), dst, n);
}
inline void row_to_floats(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }

// sum of a[j] * b[j] in a fixed order (8 lanes, then the lanes; the tail after them)
inline float dot_floats(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float tail = 0.f;
#ifdef KVSCOPE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  tail = hsum(acc);
#endif
  for (; j < n; ++j) tail = std::fma(a[j], b[j], tail);  // explicit: contraction may not vary with the inlining
  return tail;
}

// ---------------------------------------------------------------- int16 activations times int4 / int8 weights
// A weight block's codes as int16 in two halves (values 0-15 and 16-31) meet the block's pair-ordered activation
// codes in pmaddwd / vpdpwssd: a block's 32 products sum in int32 exactly (|code| <= 127, |q| <= 32767), then
// one FMA by the weight's scale; every row count runs the same operations in the same order.
#ifdef KVSCOPE_AVX2
struct BlockCodes {
  __m256i first, second;  // the block's codes 0-15 and 16-31, as int16
};

// block b of an int4 row: groups of 32 keep 16 bytes a block (codes 0-15 in the low nibbles, 16-31 in the high
// ones), a group of 64 its 32 bytes (codes 0-31 low, 32-63 high)
inline BlockCodes int4_block(const uint8_t* crow, int64_t g, int64_t b) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  if (g == 32) {
    __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(crow + b * 16)));
    return {_mm256_and_si256(t, low), _mm256_srli_epi16(t, 4)};
  }
  const uint8_t* group = crow + (b / 2) * 32;
  __m256i t0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
  __m256i t1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
  if (b % 2) return {_mm256_srli_epi16(t0, 4), _mm256_srli_epi16(t1, 4)};
  return {_mm256_and_si256(t0, low), _mm256_and_si256(t1, low)};
}

inline BlockCodes int8_block(const int8_t* crow, int64_t b) {
  const __m128i* at = reinterpret_cast<const __m128i*>(crow + b * QK);
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(at)), _mm256_cvtepi8_epi16(_mm_loadu_si128(at + 1))};
}

inline __m256i load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// sums[i] = sum over blocks b of scale(b) * (codes_b . q_i,b) for the M activation rows of x
template <int M, typename Codes, typename Scale>
inline void blocks_dot(int64_t k, const QuantizedRows& x, int64_t m, const uint8_t* stream, int64_t block_bytes,
                       Codes codes, Scale scale, float* sums) {
  int64_t nb = k / QK, rows = M > 0 ? M : m;
  __m256 acc[M > 0 ? M : MAX_ROWS];
  for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((b * block_bytes) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(stream) + b * block_bytes + PREFETCH, _MM_HINT_T0);
    BlockCodes c = codes(b);
    __m256 dw = _mm256_set1_ps(scale(b));
    int64_t first = half_at(b, 0, nb), second = half_at(b, 1, nb);
    for (int64_t i = 0; i < rows; ++i) {
      const int16_t* q = x.q.data() + i * k;
      __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(c.first, load16(q + first)), _mm256_madd_epi16(c.second, load16(q + second)));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dw, acc[i]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) sums[i] = hsum(acc[i]);
}
#endif

#ifdef KVSCOPE_AVX512
// Two blocks b, b+1 a 512-bit register: `first` holds codes 0-15 of both, `second` codes 16-31, so the products'
// lanes 0-7 are block b's sums and lanes 8-15 block b+1's (a trailing block alone: upper lanes zero). A row's
// pairs alternate between two accumulators, so an FMA does not wait for the one before.
struct PairCodes {
  __m512i first, second;
};

inline __m512 two_scales(float first, float second) {  // {first x 8, second x 8}
  return _mm512_insertf32x8(_mm512_set1_ps(first), _mm256_set1_ps(second), 1);
}

// a pair's products with one activation row (its pair-ordered codes from qb) as floats: lanes 0-7 block b's sums,
// 8-15 block b+1's (single: block b alone)
inline __m512 pair_sums(const PairCodes& c, const int16_t* qb, bool single) {
  __m512i first = single ? _mm512_maskz_loadu_epi16(0xFFFF, qb) : _mm512_loadu_si512(qb);
  __m512i second = single ? _mm512_maskz_loadu_epi16(0xFFFF, qb + 16) : _mm512_loadu_si512(qb + 2 * 16);
  return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_madd_epi16(c.first, first), c.second, second));
}

template <int G>
inline PairCodes int4_pair(const uint8_t* crow, int64_t b, bool single) {
  const __m512i low = _mm512_set1_epi16(0x0F);
  const uint8_t* at = crow + b * 16;
  __m256i bytes = single ? _mm256_maskz_loadu_epi8(0xFFFF, at) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  __m512i t = _mm512_cvtepu8_epi16(bytes);
  __m512i lows = _mm512_and_si512(t, low), highs = _mm512_srli_epi16(t, 4);
  if (G == 32) return {lows, highs};
  // a group of 64: codes 0-31 are the low nibbles, 32-63 (block b+1) the high ones
  return {_mm512_shuffle_i64x2(lows, highs, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_i64x2(lows, highs, _MM_SHUFFLE(3, 2, 3, 2))};
}

inline PairCodes int8_pair(const int8_t* crow, int64_t b, bool single) {
  __m512i w = _mm512_maskz_loadu_epi8(single ? 0xFFFFFFFFull : ~0ull, crow + b * QK);
  __m512i halves = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));  // b 0-15, b+1 0-15, b 16-31, b+1 16-31
  return {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(halves)), _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(halves, 1))};
}

// the pairs of a row of nb blocks in one order: pair(b, single, acc) for pairs 0, 4, 8, ... into even and 2, 6, ...
// into odd (alternating, so an FMA does not wait for the one before), the stream prefetched PREFETCH bytes ahead
// every 64 bytes; Acc: the activation rows' accumulators (row_sums' arrays, indexed only by constants once
// unrolled, so they stay in registers)
template <typename Pair, typename Acc>
inline void each_pair(int64_t nb, const char* stream, int64_t block_bytes, Pair pair, Acc& even, Acc& odd) {
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    _mm_prefetch(stream + b * block_bytes + PREFETCH, _MM_HINT_T0);
    pair(b, false, even);
    if (block_bytes * 2 >= 64) _mm_prefetch(stream + (b + 2) * block_bytes + PREFETCH, _MM_HINT_T0);
    pair(b + 2, false, odd);
  }
  if (b + 2 <= nb) pair(b, false, even), b += 2;
  if (b < nb) {
    if ((b / 2) % 2) pair(b, true, odd);
    else pair(b, true, even);
  }
}

// sums[i] = _mm512_reduce_add_ps(v[i]) for M registers: the same additions in the same order (so the same bits),
// up to 8 registers' at once: their halves added two registers a time (lanes j + 8), then their quarters
// (j + 4), then pairs (j + 2), then neighbours, as the reduction adds them, rows side by side
template <int M>
inline void reduce_rows(const std::array<__m512, M>& v, float* sums) {
  if constexpr (M == 1) {
    sums[0] = _mm512_reduce_add_ps(v[0]);
  } else {
    static_assert(M <= 8, "up to 8 registers");
    auto row = [&](int i) { return i < M ? v[i] : _mm512_setzero_ps(); };
    auto halves = [](__m512 a, __m512 b) {  // [a lanes 0-7 + 8-15 | b's]
      return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    auto quarters = [](__m512 p, __m512 q) {  // 4 rows' 8-lane partials -> their 4-lane ones, a row a 128-bit lane
      return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
    };
    __m512 first = quarters(halves(row(0), row(1)), halves(row(2), row(3)));
    __m512 second = M > 4 ? quarters(halves(row(4), row(5)), halves(row(6), row(7))) : _mm512_setzero_ps();
    __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(first, second, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(first, second, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 total = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(2, 3, 0, 1)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, total);  // row i < 4 in lane 4i, row i >= 4 in lane 4(i - 4) + 2
    for (int i = 0; i < M; ++i) sums[i] = lanes[i < 4 ? 4 * i : 4 * (i - 4) + 2];
  }
}

// one weight row (crow, nb blocks of block_bytes) against M activation rows (q: their pair-ordered codes, k apart):
// each row's sum over its pairs through each_pair, codes(b, single) -> PairCodes, scale(b, single) -> the pair's
// weight scales; inlined into the row loops, so that the 2M accumulators stay in registers
template <int M, typename Codes, typename Scale>
__attribute__((always_inline)) inline void row_sums(int64_t nb, const void* crow, int64_t block_bytes, const int16_t* q,
                                                    int64_t k, Codes codes, Scale scale, float* sums) {
  std::array<__m512, M> even, odd;
  even.fill(_mm512_setzero_ps()), odd.fill(_mm512_setzero_ps());
  auto pair = [&](int64_t b, bool single, std::array<__m512, M>& acc) {
    PairCodes c = codes(b, single);
    __m512 s = scale(b, single);
    for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(pair_sums(c, q + i * k + b * QK, single), s, acc[i]);
  };
  each_pair(nb, static_cast<const char*>(crow), block_bytes, pair, even, odd);
  for (int i = 0; i < M; ++i) even[i] = _mm512_add_ps(even[i], odd[i]);
  reduce_rows<M>(even, sums);
}
#endif

inline int int4_code(const uint8_t* crow, int64_t g, int64_t gi, int64_t pos) {  // pos within the group
  const uint8_t* gb = crow + gi * (g / 2);
  return pos < g / 2 ? (gb[pos] & 15) : (gb[pos - g / 2] >> 4);
}

// sum over blocks of scale(b) * (code(b, j) . q_i,b): the portable path's integers (and block order)
template <typename Code, typename Scale>
inline float blocks_dot_scalar(int64_t k, const QuantizedRows& x, int64_t i, Code code, Scale scale) {
  int64_t nb = k / QK;
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int isum = 0;
    for (int h = 0; h < 2; ++h) {
      const int16_t* q = x.q.data() + i * k + half_at(b, h, nb);
      for (int j = 0; j < 16; ++j) isum += code(b, h * 16 + j) * q[j];
    }
    total = std::fma(scale(b), static_cast<float>(isum), total);  // explicit: contraction may not vary
  }
  return total;
}

// one int4 row (codes crow, float scales dw / minimums mw per group) times M activation rows -> out[i * n]
template <int M, int G>
inline void int4_row(const uint8_t* crow, const float* dw, const float* mw, int64_t k, const QuantizedRows& x,
                     const float* xsg, int64_t m, float* out, int64_t n) {
  int64_t groups = k / G, rows = M > 0 ? M : m;
  float sums[M > 0 ? M : MAX_ROWS];
#if defined(KVSCOPE_AVX2)  // (AVX-512: int4_rows)
  blocks_dot<M>(k, x, m, crow, QK / 2, [&](int64_t b) { return int4_block(crow, G, b); },
                [&](int64_t b) { return dw[b * QK / G]; }, sums);
#else
  for (int64_t i = 0; i < rows; ++i)
    sums[i] = blocks_dot_scalar(
        k, x, i, [&](int64_t b, int64_t j) { return int4_code(crow, G, b * QK / G, (b * QK) % G + j); },
        [&](int64_t b) { return dw[b * QK / G]; });
#endif
  for (int64_t i = 0; i < rows; ++i) out[i * n] = (sums[i] + dot_floats(mw, xsg + i * groups, groups)) * x.d[i];
}

#if defined(KVSCOPE_AVX512)
// the int4 minimums' term of one weight row for M activation rows: terms[i] = dot_floats(mw, xsg_i, groups). Where
// M rows' dot_floats would take more instructions than one pass over the groups, that pass: the same operations
// in the same order (so the same bits) with the rows along the lanes of one register (by_group[g * MAX_ROWS + i]
// = xsg_i[g]): dot_floats' 8 chains (g % 8), its sums of them, then its tail.
template <int M>
inline void minimum_terms(const float* mw, const float* by_group, const float* xsg, int64_t groups, float* terms) {
  if constexpr (M == 1) {
    terms[0] = dot_floats(mw, xsg, groups);
  } else if (M * (groups / 8 + 8) <= groups + 8) {
    for (int i = 0; i < M; ++i) terms[i] = dot_floats(mw, xsg + i * groups, groups);
  } else {
    static_assert(M <= 8, "a register of rows");
    auto at = [&](int64_t g) { return _mm256_loadu_ps(by_group + g * MAX_ROWS); };
    std::array<__m256, 8> acc;
    acc.fill(_mm256_setzero_ps());
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      for (int l = 0; l < 8; ++l) acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(mw[g + l]), at(g + l), acc[l]);
    __m256 low = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));  // as hsum adds them
    __m256 high = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    __m256 sum = _mm256_add_ps(low, high);
    for (; g < groups; ++g) sum = _mm256_fmadd_ps(_mm256_set1_ps(mw[g]), at(g), sum);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    for (int i = 0; i < M; ++i) terms[i] = lanes[i];
  }
}

// int4_row<M, G> for the weight rows [n0, n1) in one loop, M (1 to 8) activation rows: the same operations in the
// same order for every M (so the same bits), the 2M accumulators in one function (a call per weight row realigned
// its stack, zeroed, spilled and reloaded them: ~10 of ~28 ns a row at M = 1, ~7% of a batch of 8's step).
// dw, mw: scratch of `groups` floats.
template <int M, int G>
__attribute__((noinline)) void int4_rows(const uint8_t* c, const uint16_t* sc, const uint16_t* mn, int64_t k,
                                         const QuantizedRows& x, int64_t r0, const float* xsg,
                                         const float* xsg_by_group, float* out, int64_t n0, int64_t n1, int64_t n,
                                         float* dw, float* mw) {
  const int64_t nb = k / QK, groups = k / G;
  const int16_t* q = x.q.data() + r0 * k;
  const float* d = x.d.data() + r0;
  const float* xsg_rows = xsg_by_group + r0;
  out += r0 * n;
  for (int64_t row = n0; row < n1; ++row) {
    prefetch_params(sc, mn, row + PARAMS_AHEAD, groups, n);
    halves_to_floats(sc + row * groups, dw, groups);
    halves_to_floats(mn + row * groups, mw, groups);
    const uint8_t* crow = c + row * (k / 2);
    float sums[M];
    row_sums<M>(
        nb, crow, QK / 2, q, k, [&](int64_t b, bool single) { return int4_pair<G>(crow, b, single); },
        [&](int64_t b, bool single) {
          return G == 64 ? _mm512_set1_ps(dw[b / 2]) : two_scales(dw[b], single ? 0.f : dw[b + 1]);
        },
        sums);
    float terms[M];
    minimum_terms<M>(mw, xsg_rows, xsg + r0 * groups, groups, terms);
    for (int i = 0; i < M; ++i) out[i * n + row] = (sums[i] + terms[i]) * d[i];
  }
}
#endif

constexpr int64_t ROW_BLOCK = 16;  // weight rows the decode layouts interleave (int4_row_block())

#if defined(KVSCOPE_AVX2)
// ---- int4 weights 16 rows a register (the decode layout wherever AVX2 is built): the weight rows in groups
// of 16, each group stored block by block, 256 bytes a block of 32 codes: byte 32j + 2r + e holds code 2j + e of
// row r in its low nibble and code 2j + 16 + e in its high one (j = 0..7, e = 0..1); the scales and minimums as
// [N/16, G, 16]. Widened to int16, a 32-bit lane holds two codes of one row, and vpdpwssd with an activation pair
// broadcast to every lane sums 16 rows at once, each row's block in its own lane as an exact int32: no horizontal
// sums, one conversion and one FMA by 16 rows' scales a block. Per output row: the blocks in order, each
// acc = fma(block sum, scale, acc), a group's minimum term acc = fma(minimum, its activation sum, acc) after its
// last block, then acc * d_x: the same operations whatever the number of activation rows. (Rows one at a time,
// as int4_rows reads them, took ~2x the instructions: a horizontal sum and the minimums' dot product a row.)
// On AVX2 a 256-bit register holds 8 rows' lanes and pmaddwd + paddd stand for vpdpwssd: each group of 16 rows is
// read as two halves, rows 0-7, then rows 8-15 (their bytes, beside the first half's in every 32, are in L1 by
// then), with the same integers and the same float operations a lane: by construction the AVX-512 kernel's bits
// (not compared across machines).
constexpr int64_t ROW_BLOCK_BYTES = ROW_BLOCK * QK / 2;
constexpr int64_t INT8_BLOCK_BYTES = ROW_BLOCK * QK;  // the int8 layout's (below)
// measured on a 2-core EPYC (Zen 4) VM, the default model's 120 projections streamed at one row: 2 KiB ahead into
// L1 ran at ~15 GB/s, 16 KiB ahead into L2 at ~21 GB/s (the memory's own speed then); no prefetch ~13 GB/s
constexpr int64_t ROWS16_PREFETCH = 16384;

// the cache lines of [p, p + bytes) `distance` bytes further on, into L2 (a 16-row kernel's stream, read ahead)
__attribute__((always_inline)) inline void prefetch_ahead(const void* p, int64_t bytes, int64_t distance) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + distance + off, _MM_HINT_T1);
}

// The activations as the 16-row kernels read them: for each of in_row_groups' groups (r0 a multiple of ROW_GROUP,
// mg = min(ROW_GROUP, m - r0) rows), block b's 16 int16 pairs row-interleaved, [nb, 16, mg] int32 from
// r0 * k / 2: pair p < 8 is codes 2p, 2p + 1 of the block's first half, p >= 8 codes 2(p - 8), +1 of its second.
// Every broadcast of a block then lies at a constant offset from one pointer (with rows k apart, GCC computed and
// spilled an address a row and a pair: ~2 scalar instructions a vpdpwssd at 8 rows). Every entry is written (no zeros).
std::unique_ptr<int32_t[]> pair_grid(const QuantizedRows& x, int64_t m, int64_t k) {
  const int64_t nb = k / QK;
  std::unique_ptr<int32_t[]> grid(new int32_t[m * k / 2]);
  for (int64_t r0 = 0; r0 < m; r0 += ROW_GROUP) {
    const int64_t mg = std::min<int64_t>(ROW_GROUP, m - r0);
    int32_t* g = grid.get() + r0 * k / 2;
    for (int64_t i = 0; i < mg; ++i) {
      const int16_t* q = x.q.data() + (r0 + i) * k;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t p = 0; p < 16; ++p)
          std::memcpy(g + (b * 16 + p) * mg + i, q + half_at(b, p / 8, nb) + 2 * (p % 8), sizeof(int32_t));
    }
  }
  return grid;
}

#if defined(KVSCOPE_AVX512)
// acc + codes times the pair of int16 at p in every lane: vpdpwssd's embedded broadcast (the load unit repeats it);
// GCC emitted most as a vpbroadcastd and a vpdpwssd, measured 1-5% of a projection's time at 1 to 16 rows (in the
// KV attention's key scores, vpdpbusd's the same way measured no faster)
__attribute__((always_inline)) inline __m512i dpwssd_broadcast(__m512i acc, __m512i codes, const void* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}

// The 16-row kernels' frame: for each group of 16 weight rows in [g0, g1), f(gi, acc) adds its blocks into acc (M
// registers, one an activation row, zeroed first); then each row's 16 outputs = acc * d_x
template <int M, typename F>
__attribute__((always_inline)) inline void each_row_group16(const QuantizedRows& x, int64_t r0, float* out,
                                                            int64_t g0, int64_t g1, int64_t n, F f) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    std::array<__m512, M> acc;
    acc.fill(_mm512_setzero_ps());
    f(gi, acc);
    for (int i = 0; i < M; ++i)
      _mm512_storeu_ps(out + (r0 + i) * n + gi * ROW_BLOCK, _mm512_mul_ps(acc[i], _mm512_set1_ps(x.d[r0 + i])));
  }
}

// acc[i] = fma(row i's block sums (its A chains of int32 added), the 16 rows' scales, acc[i])
template <int M, int A>
__attribute__((always_inline)) inline void add_block(const std::array<std::array<__m512i, A>, M>& sums, __m512 scale,
                                                     std::array<__m512, M>& acc) {
  for (int i = 0; i < M; ++i) {
    __m512i total = sums[i][0];
    for (int a = 1; a < A; ++a) total = _mm512_add_epi32(total, sums[i][a]);
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[i]);
  }
}

template <int M, int G>
__attribute__((noinline)) void int4_groups16(const uint8_t* c, const uint16_t* sc, const uint16_t* mn, int64_t k,
                                             const QuantizedRows& x, const int32_t* grid, int64_t r0,
                                             const float* xsg, float* out, int64_t g0, int64_t g1, int64_t n) {
  const int64_t nb = k / QK, groups = k / G;
  constexpr int A = M == 1 ? 4 : M <= 7 ? 2 : 1;  // int32 accumulators a row: chains of dpwssd side by side
  const __m512i low = _mm512_set1_epi16(0x0F);
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_group16<M>(x, r0, out, g0, g1, n, [&](int64_t gi, std::array<__m512, M>& acc) {
    const uint8_t* cg = c + gi * nb * ROW_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK;
    const uint16_t* mg = mn + gi * groups * ROW_BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* cb = cg + b * ROW_BLOCK_BYTES;
      const uint16_t *sb = sg + (b * QK / G) * ROW_BLOCK, *mb = mg + (b * QK / G) * ROW_BLOCK;
      prefetch_ahead(cb, ROW_BLOCK_BYTES, ROWS16_PREFETCH);
      if (b % 2 == 0)  // 32 bytes a block each
        prefetch_ahead(sb, 1, ROWS16_PREFETCH / 8), prefetch_ahead(mb, 1, ROWS16_PREFETCH / 8);
      std::array<std::array<__m512i, A>, M> sums;
      for (auto& row : sums) row.fill(_mm512_setzero_si512());
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 32 * j)));
        __m512i first = _mm512_and_si512(t, low), second = _mm512_srli_epi16(t, 4);  // codes 2j.., 2j + 16..
        for (int i = 0; i < M; ++i) {
          auto& s0 = sums[i][j % A];  // the activation pairs (2j, 2j + 1) and (2j + 16, 2j + 17) of the block
          auto& s1 = sums[i][(j + A / 2) % A];
          s0 = dpwssd_broadcast(s0, first, pb + j * M + i);
          s1 = dpwssd_broadcast(s1, second, pb + (8 + j) * M + i);
        }
      }
      add_block<M, A>(sums, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb))), acc);
      if ((b * QK) % G == G - QK) {  // the group's last block: its minimums times the group's activation sums
        __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mb)));
        for (int i = 0; i < M; ++i)
          acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsg[(r0 + i) * groups + b * QK / G]), acc[i]);
      }
    }
  });
}

// ---- int8 weights 16 rows a register, as the int4 layout above: 512 bytes a block of 32 codes, byte 32j + 2r + e
// holds code 2j + e of row r (j = 0..15, e = 0..1); the scales as [N/16, G, 16]. Sign-extended to int16, a 32-bit
// lane holds two codes of one row, and vpdpwssd with an activation pair sums 16 rows at once. Per output row: the
// blocks in order, acc = fma(block sum, scale, acc), then acc * d_x, whatever the number of activation rows. (Rows
// one at a time, as int8_rows reads them, spent ~1.5x the int8 head's bytes' time in horizontal sums.)
template <int M>
__attribute__((noinline)) void int8_groups16(const int8_t* c, const uint16_t* sc, int64_t k, int64_t groups,
                                             const QuantizedRows& x, const int32_t* grid, int64_t r0, float* out,
                                             int64_t g0, int64_t g1, int64_t n) {
  const int64_t nb = k / QK, per = nb / groups;  // blocks a scale group
  constexpr int A = M == 1 ? 4 : M <= 7 ? 2 : 1;  // int32 accumulators a row: chains of dpwssd side by side
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_group16<M>(x, r0, out, g0, g1, n, [&](int64_t gi, std::array<__m512, M>& acc) {
    const int8_t* cg = c + gi * nb * INT8_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* cb = cg + b * INT8_BLOCK_BYTES;
      prefetch_ahead(cb, INT8_BLOCK_BYTES, ROWS16_PREFETCH);
      const uint16_t* sb = sg + (b / per) * ROW_BLOCK;
      if (b % per == 0) prefetch_ahead(sb, 1, ROWS16_PREFETCH / 16);
      std::array<std::array<__m512i, A>, M> sums;
      for (auto& row : sums) row.fill(_mm512_setzero_si512());
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {  // codes 2j, 2j + 1 of each row: the block's half j / 8, pair j % 8
        __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 32 * j)));
        for (int i = 0; i < M; ++i) sums[i][j % A] = dpwssd_broadcast(sums[i][j % A], codes, pb + j * M + i);
      }
      add_block<M, A>(sums, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb))), acc);
    }
  });
}

#else
// The 16-row kernels' frame on AVX2: each group of 16 weight rows in [g0, g1) as two halves of 8 rows (h = 0, 1);
// f(gi, h, acc) adds half h's blocks into acc (M registers, one an activation row, zeroed first); then each row's
// 8 outputs = acc * d_x
template <int M, typename F>
__attribute__((always_inline)) inline void each_row_half8(const QuantizedRows& x, int64_t r0, float* out, int64_t g0,
                                                          int64_t g1, int64_t n, F f) {
  for (int64_t gi = g0; gi < g1; ++gi)
    for (int h = 0; h < 2; ++h) {
      std::array<__m256, M> acc;
      acc.fill(_mm256_setzero_ps());
      f(gi, h, acc);
      for (int i = 0; i < M; ++i)
        _mm256_storeu_ps(out + (r0 + i) * n + gi * ROW_BLOCK + 8 * h, _mm256_mul_ps(acc[i], _mm256_set1_ps(x.d[r0 + i])));
    }
}

// acc + codes (8 rows' pairs of int16) times the pair of int16 at p in every lane: 8 exact int32. The empty asm
// keeps each sum in its register: GCC otherwise reassociated a block's integer sums into a tree, computing every
// product first and spilling them to the stack (the default model's projections at 8 rows took 1.8x as long)
__attribute__((always_inline)) inline __m256i madd_add(__m256i acc, __m256i codes, const int32_t* p) {
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(codes, _mm256_set1_epi32(*p)));
  asm("" : "+x"(acc));
  return acc;
}

// acc[i] = fma(row i's block sums, the 8 rows' scales, acc[i])
template <int M>
__attribute__((always_inline)) inline void add_block8(const std::array<__m256i, M>& sums, __m256 scale,
                                                      std::array<__m256, M>& acc) {
  for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), scale, acc[i]);
}

// One to three activation rows (a decode step's one, a few streams or verify rows): both halves of a group of 16
// rows in one pass over each block (the 16 rows' lanes of a 32-byte line widened as two registers, rows 0-7 and
// 8-15), so every line is read once, when it arrives, where the two passes below read half of each line and then the
// other half. The same integer sums and float steps a lane (the same bits). In a standalone loop (Zen 3) the default
// model's weights streamed at 21 against 16 GB/s at one row, and 1.08x / 1.2x the GMAC/s at two / three rows; at
// four rows and more the 2 x M chains of sums spilled (0.6-0.8x): those keep the two passes.
constexpr int ONE_PASS_ROWS = 3;

// C int32 chains of sums per row and half: two at one row (the first and the second codes apart), one above
template <int M> constexpr int ONE_PASS_CHAINS = M == 1 ? 2 : 1;

// for each group of 16 rows in [g0, g1): block(gi, acc) adds its blocks into acc ([row][half], zeroed first), then
// each row's 16 outputs = acc * d_x
template <int M, typename Block>
__attribute__((always_inline)) inline void each_row_group_once(const QuantizedRows& x, int64_t r0, float* out,
                                                               int64_t g0, int64_t g1, int64_t n, Block block) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    std::array<std::array<__m256, 2>, M> acc;
    for (auto& row : acc) row.fill(_mm256_setzero_ps());
    block(gi, acc);
    for (int i = 0; i < M; ++i)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(out + (r0 + i) * n + gi * ROW_BLOCK + 8 * h,
                         _mm256_mul_ps(acc[i][h], _mm256_set1_ps(x.d[r0 + i])));
  }
}

// a block's int32 sums of M rows, [row][half][chain]
template <int M, int C> using OnePassSums = std::array<std::array<std::array<__m256i, C>, 2>, M>;

// acc[i][h] = fma(row i's half-h block sums (its C chains added), the half's 8 scales, acc[i][h])
template <int M, int C>
__attribute__((always_inline)) inline void add_block_once(const OnePassSums<M, C>& sums, const uint16_t* scales,
                                                          std::array<std::array<__m256, 2>, M>& acc) {
  for (int h = 0; h < 2; ++h) {
    __m256 scale = halves8(scales + 8 * h);
    for (int i = 0; i < M; ++i) {
      __m256i total = sums[i][h][0];
      for (int a = 1; a < C; ++a) total = _mm256_add_epi32(total, sums[i][h][a]);
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[i][h]);
    }
  }
}

template <int M, int G>
void int4_group16_once(const uint8_t* c, const uint16_t* sc, const uint16_t* mn, int64_t k, const QuantizedRows& x,
                       const int32_t* grid, int64_t r0, const float* xsg, float* out, int64_t g0, int64_t g1,
                       int64_t n) {
  const int64_t nb = k / QK, groups = k / G;
  constexpr int C = ONE_PASS_CHAINS<M>;
  const __m256i low = _mm256_set1_epi16(0x0F);
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_group_once<M>(x, r0, out, g0, g1, n, [&](int64_t gi, std::array<std::array<__m256, 2>, M>& acc) {
    const uint8_t* cg = c + gi * nb * ROW_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK;
    const uint16_t* mg = mn + gi * groups * ROW_BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* cb = cg + b * ROW_BLOCK_BYTES;
      const uint16_t *sb = sg + (b * QK / G) * ROW_BLOCK, *mb = mg + (b * QK / G) * ROW_BLOCK;
      prefetch_ahead(cb, ROW_BLOCK_BYTES, ROWS16_PREFETCH);
      if (b % 2 == 0) prefetch_ahead(sb, 1, ROWS16_PREFETCH / 8), prefetch_ahead(mb, 1, ROWS16_PREFETCH / 8);
      OnePassSums<M, C> sums{};
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 32 * j + 16 * h)));
          __m256i first = _mm256_and_si256(t, low), second = _mm256_srli_epi16(t, 4);  // codes 2j.., 2j + 16..
#pragma GCC unroll 4
          for (int i = 0; i < M; ++i) {
            sums[i][h][0] = madd_add(sums[i][h][0], first, pb + j * M + i);
            sums[i][h][C - 1] = madd_add(sums[i][h][C - 1], second, pb + (8 + j) * M + i);
          }
        }
      add_block_once<M, C>(sums, sb, acc);
      if ((b * QK) % G == G - QK)  // the group's last block: its minimums times the group's activation sums
        for (int h = 0; h < 2; ++h) {
          __m256 minimum = halves8(mb + 8 * h);
          for (int i = 0; i < M; ++i)
            acc[i][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsg[(r0 + i) * groups + b * QK / G]), acc[i][h]);
        }
    }
  });
}

// four to eight activation rows: rows 0-7 of each group of 16, then rows 8-15
template <int M, int G>
void int4_halves16(const uint8_t* c, const uint16_t* sc, const uint16_t* mn, int64_t k, const QuantizedRows& x,
                   const int32_t* grid, int64_t r0, const float* xsg, float* out, int64_t g0, int64_t g1, int64_t n) {
  const int64_t nb = k / QK, groups = k / G;
  const __m256i low = _mm256_set1_epi16(0x0F);
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_half8<M>(x, r0, out, g0, g1, n, [&](int64_t gi, int h, std::array<__m256, M>& acc) {
    const uint8_t* cg = c + gi * nb * ROW_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK + 8 * h;
    const uint16_t* mg = mn + gi * groups * ROW_BLOCK + 8 * h;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* cb = cg + b * ROW_BLOCK_BYTES;
      const uint16_t *sb = sg + (b * QK / G) * ROW_BLOCK, *mb = mg + (b * QK / G) * ROW_BLOCK;
      if (h == 0) {  // the first half's pass brings every line of the block
        prefetch_ahead(cb, ROW_BLOCK_BYTES, ROWS16_PREFETCH);
        if (b % 2 == 0) prefetch_ahead(sb, 1, ROWS16_PREFETCH / 8), prefetch_ahead(mb, 1, ROWS16_PREFETCH / 8);
      }
      std::array<__m256i, M> sums;  // one int32 chain a row: four rows and more are chains enough side by side
      sums.fill(_mm256_setzero_si256());
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 32 * j + 16 * h)));
        __m256i first = _mm256_and_si256(t, low), second = _mm256_srli_epi16(t, 4);  // codes 2j.., 2j + 16..
        for (int i = 0; i < M; ++i) {
          sums[i] = madd_add(sums[i], first, pb + j * M + i);
          sums[i] = madd_add(sums[i], second, pb + (8 + j) * M + i);
        }
      }
      add_block8<M>(sums, halves8(sb), acc);
      if ((b * QK) % G == G - QK) {  // the group's last block: its minimums times the group's activation sums
        __m256 minimum = halves8(mb);
        for (int i = 0; i < M; ++i)
          acc[i] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsg[(r0 + i) * groups + b * QK / G]), acc[i]);
      }
    }
  });
}

template <int M>
void int8_group16_once(const int8_t* c, const uint16_t* sc, int64_t k, int64_t groups, const QuantizedRows& x,
                       const int32_t* grid, int64_t r0, float* out, int64_t g0, int64_t g1, int64_t n) {
  const int64_t nb = k / QK, per = nb / groups;  // blocks a scale group
  constexpr int C = ONE_PASS_CHAINS<M>;
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_group_once<M>(x, r0, out, g0, g1, n, [&](int64_t gi, std::array<std::array<__m256, 2>, M>& acc) {
    const int8_t* cg = c + gi * nb * INT8_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* cb = cg + b * INT8_BLOCK_BYTES;
      const uint16_t* sb = sg + (b / per) * ROW_BLOCK;
      prefetch_ahead(cb, INT8_BLOCK_BYTES, ROWS16_PREFETCH);
      if (b % per == 0) prefetch_ahead(sb, 1, ROWS16_PREFETCH / 16);
      OnePassSums<M, C> sums{};
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 32 * j + 16 * h)));
#pragma GCC unroll 4
          for (int i = 0; i < M; ++i) sums[i][h][j % C] = madd_add(sums[i][h][j % C], codes, pb + j * M + i);
        }
      add_block_once<M, C>(sums, sb, acc);
    }
  });
}

template <int M>
void int8_halves16(const int8_t* c, const uint16_t* sc, int64_t k, int64_t groups, const QuantizedRows& x,
                   const int32_t* grid, int64_t r0, float* out, int64_t g0, int64_t g1, int64_t n) {
  const int64_t nb = k / QK, per = nb / groups;  // blocks a scale group
  const int32_t* pairs = grid + r0 * k / 2;
  each_row_half8<M>(x, r0, out, g0, g1, n, [&](int64_t gi, int h, std::array<__m256, M>& acc) {
    const int8_t* cg = c + gi * nb * INT8_BLOCK_BYTES;
    const uint16_t* sg = sc + gi * groups * ROW_BLOCK + 8 * h;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* cb = cg + b * INT8_BLOCK_BYTES;
      const uint16_t* sb = sg + (b / per) * ROW_BLOCK;
      if (h == 0) {
        prefetch_ahead(cb, INT8_BLOCK_BYTES, ROWS16_PREFETCH);
        if (b % per == 0) prefetch_ahead(sb, 1, ROWS16_PREFETCH / 16);
      }
      std::array<__m256i, M> sums;  // one int32 chain a row
      sums.fill(_mm256_setzero_si256());
      const int32_t* pb = pairs + b * 16 * M;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {  // codes 2j, 2j + 1 of each row: the block's half j / 8, pair j % 8
        __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 32 * j + 16 * h)));
        for (int i = 0; i < M; ++i) sums[i] = madd_add(sums[i], codes, pb + j * M + i);
      }
      add_block8<M>(sums, halves8(sb), acc);
    }
  });
}

template <int M, int G>
__attribute__((noinline)) void int4_groups16(const uint8_t* c, const uint16_t* sc, const uint16_t* mn, int64_t k,
                                             const QuantizedRows& x, const int32_t* grid, int64_t r0,
                                             const float* xsg, float* out, int64_t g0, int64_t g1, int64_t n) {
  if constexpr (M <= ONE_PASS_ROWS)
    int4_group16_once<M, G>(c, sc, mn, k, x, grid, r0, xsg, out, g0, g1, n);
  else
    int4_halves16<M, G>(c, sc, mn, k, x, grid, r0, xsg, out, g0, g1, n);
}

template <int M>
__attribute__((noinline)) void int8_groups16(const int8_t* c, const uint16_t* sc, int64_t k, int64_t groups,
                                             const QuantizedRows& x, const int32_t* grid, int64_t r0, float* out,
                                             int64_t g0, int64_t g1, int64_t n) {
  if constexpr (M <= ONE_PASS_ROWS)
    int8_group16_once<M>(c, sc, k, groups, x, grid, r0, out, g0, g1, n);
  else
    int8_halves16<M>(c, sc, k, groups, x, grid, r0, out, g0, g1, n);
}
#endif

// int4_linear over the 16-row layout: codes [N/16, K/32, 256] uint8, scales and minimums [N/16, G, 16] float16;
// any number of activation rows (a prefill's too: in groups of 8 over L2-sized spans, 2.2x a float32 matmul of
// the dequantized weights for a 512-token prompt on a Zen 4 with AVX-512, 1.6x on a Zen 3 with AVX2)
at::Tensor int4_linear16(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& minimums) {
  TORCH_CHECK(codes.size(2) == ROW_BLOCK_BYTES && scales.dim() == 3 && scales.size(2) == ROW_BLOCK &&
                  minimums.sizes() == scales.sizes() && scales.size(0) == codes.size(0) && codes.is_contiguous() &&
                  scales.is_contiguous() && minimums.is_contiguous(),
              "int4 16-row layout: codes [N/16, K/32, 256], scales and minimums [N/16, G, 16], contiguous");
  int64_t row_groups = codes.size(0), nb = codes.size(1), k = nb * QK, n = row_groups * ROW_BLOCK;
  InputRows x = as_rows(input, k, n);
  int64_t m = x.m, groups = scales.size(1), g = k / groups;
  TORCH_CHECK(k % groups == 0 && (g == 32 || g == 64), "int4: groups of 32/64");
  auto rows = quantize_rows(x.data, m, k);
  std::vector<float> xsg = group_sums(rows, m, k, groups);
  std::unique_ptr<int32_t[]> grid = pair_grid(rows, m, k);
  at::Tensor y = x.output;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mn = reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  parallel_chunks(row_groups, two_a_thread(row_groups, 4), [&](int64_t g0, int64_t g1) {
    in_row_groups(m, g0, g1, nb * ROW_BLOCK_BYTES, [&](int64_t r0, auto rows_m, int64_t u0, int64_t u1) {
      constexpr int M = decltype(rows_m)::value;
      auto groups16 = g == 32 ? int4_groups16<M, 32> : int4_groups16<M, 64>;
      groups16(c, sc, mn, k, rows, grid.get(), r0, xsg.data(), out, u0, u1, n);
    });
  });
  return y;
}

// int8_linear over the 16-row layout: codes [N/16, K/32, 512] int8, scales [N/16, G, 16] float16; any number of
// activation rows
at::Tensor int8_linear16(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.size(2) == INT8_BLOCK_BYTES && scales.dim() == 3 && scales.size(2) == ROW_BLOCK &&
                  scales.size(0) == codes.size(0) && codes.is_contiguous() && scales.is_contiguous(),
              "int8 16-row layout: codes [N/16, K/32, 512], scales [N/16, G, 16], contiguous");
  int64_t row_groups = codes.size(0), nb = codes.size(1), k = nb * QK, n = row_groups * ROW_BLOCK;
  InputRows x = as_rows(input, k, n);
  int64_t m = x.m, groups = scales.size(1);
  TORCH_CHECK(groups > 0 && nb % groups == 0, "int8: the group a multiple of 32");
  auto rows = quantize_rows(x.data, m, k);
  std::unique_ptr<int32_t[]> grid = pair_grid(rows, m, k);
  at::Tensor y = x.output;
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  parallel_chunks(row_groups, two_a_thread(row_groups, 4), [&](int64_t g0, int64_t g1) {
    in_row_groups(m, g0, g1, nb * INT8_BLOCK_BYTES, [&](int64_t r0, auto rows_m, int64_t u0, int64_t u1) {
      int8_groups16<decltype(rows_m)::value>(c, sc, k, groups, rows, grid.get(), r0, out, u0, u1, n);
    });
  });
  return y;
}
#endif

// int4 weights: w = code * scale + minimum. codes: [N, K/2] uint8, per group of g (32 or 64) byte j = code j |
// code j + g/2 << 4 (GGUF's Q4_0 / Q4_1 order); scales, minimums: [N, K/g] float16.
// y[m, n] = d_x[m] * (sum over blocks b: d_w * (codes . xq) + sum over groups: min_w * (sum of xq)), xq the int16 codes.
at::Tensor int4_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& minimums) {
  if (codes.dim() == 3) {
#if defined(KVSCOPE_AVX2)
    return int4_linear16(input, codes, scales, minimums);
#else
    TORCH_CHECK(false, "int4: the 16-row layout needs kernels built for AVX2 (int4_row_block() == 0)");
#endif
  }
  int64_t k = codes.size(1) * 2, n = codes.size(0);
  InputRows x = as_rows(input, k, n);
  int64_t m = x.m;
  int64_t groups = scales.size(1), g = k / groups;
  TORCH_CHECK(m <= MAX_ROWS, "int4_linear takes at most 16 rows");
  TORCH_CHECK(k % QK == 0 && (g == 32 || g == 64) && codes.size(1) * 2 == k, "int4: K % 32 and groups of 32/64");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && minimums.is_contiguous(), "contiguous weights");
  auto rows = quantize_rows(x.data, m, k);
  std::vector<float> xsg = group_sums(rows, m, k, groups);
#if defined(KVSCOPE_AVX512)
  // the same, [group][row] (+ a register's overrun), for minimum_terms' pass over several rows (one row: unused)
  std::vector<float> xsg_by_group(m > 1 ? groups * MAX_ROWS + 8 : 0, 0.f);
  for (int64_t i = 0; m > 1 && i < m; ++i)
    for (int64_t j = 0; j < groups; ++j) xsg_by_group[j * MAX_ROWS + i] = xsg[i * groups + j];
#endif
  at::Tensor y = x.output;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mn = reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  parallel_chunks(n, grain_for(n), [&](int64_t n0, int64_t n1) {
    std::vector<float> dw(groups), mw(groups);
#if defined(KVSCOPE_AVX512)
    return in_row_groups(m, n0, n1, k / 2, [&](int64_t r0, auto rows_m, int64_t u0, int64_t u1) {
      constexpr int M = decltype(rows_m)::value;
      (g == 32 ? int4_rows<M, 32> : int4_rows<M, 64>)(c, sc, mn, k, rows, r0, xsg.data(), xsg_by_group.data(), out,
                                                      u0, u1, n, dw.data(), mw.data());
    });
#endif
    for (int64_t row = n0; row < n1; ++row) {
      prefetch_params(sc, mn, row + PARAMS_AHEAD, groups, n);
      halves_to_floats(sc + row * groups, dw.data(), groups);
      halves_to_floats(mn + row * groups, mw.data(), groups);
      const uint8_t* crow = c + row * (k / 2);
      with_rows(m, [&](auto rows_m) {
        constexpr int M = decltype(rows_m)::value;
        (g == 32 ? int4_row<M, 32> : int4_row<M, 64>)(crow, dw.data(), mw.data(), k, rows, xsg.data(), m, out + row, n);
      });
    }
  });
  return y;
}

// one int8 row (codes crow, a float scale per block of 32: dw) times M activation rows -> out[i * n]
template <int M>  // not inlined into the caller's loop: there its accumulators spilled to the stack
__attribute__((noinline)) void int8_row(const int8_t* crow, const float* dw, int64_t k, const QuantizedRows& x, int64_t m, float* out,
                     int64_t n) {
  int64_t rows = M > 0 ? M : m;
  float sums[M > 0 ? M : MAX_ROWS];
  const uint8_t* stream = reinterpret_cast<const uint8_t*>(crow);
#if defined(KVSCOPE_AVX2)  // (AVX-512: int8_rows)
  blocks_dot<M>(k, x, m, stream, QK, [&](int64_t b) { return int8_block(crow, b); }, [&](int64_t b) { return dw[b]; },
                sums);
#else
  for (int64_t i = 0; i < rows; ++i)
    sums[i] = blocks_dot_scalar(
        k, x, i, [&](int64_t b, int64_t j) { return static_cast<int>(crow[b * QK + j]); }, [&](int64_t b) { return dw[b]; });
#endif
  for (int64_t i = 0; i < rows; ++i) out[i * n] = sums[i] * x.d[i];
}

#if defined(KVSCOPE_AVX512)
// int8_row<M> for the weight rows [n0, n1) in one loop, as int4_rows: the same operations and order, the
// accumulators in one function. dw: scratch of `groups` floats; blocks: nb floats when per > 1.
template <int M>
__attribute__((noinline)) void int8_rows(const int8_t* c, const uint16_t* sc, int64_t k, int64_t groups, int64_t per,
                                         const QuantizedRows& x, int64_t r0, float* out, int64_t n0, int64_t n1,
                                         int64_t n, float* dw, float* blocks) {
  const int64_t nb = k / QK;
  const int16_t* q = x.q.data() + r0 * k;
  const float* d = x.d.data() + r0;
  out += r0 * n;
  for (int64_t row = n0; row < n1; ++row) {
    prefetch_params(sc, nullptr, row + PARAMS_AHEAD, groups, n);
    halves_to_floats(sc + row * groups, dw, groups);
    for (int64_t b = 0; per > 1 && b < nb; ++b) blocks[b] = dw[b / per];
    const float* bs = per > 1 ? blocks : dw;
    const int8_t* crow = c + row * k;
    float sums[M];
    row_sums<M>(
        nb, crow, QK, q, k, [&](int64_t b, bool single) { return int8_pair(crow, b, single); },
        [&](int64_t b, bool single) { return two_scales(bs[b], single ? 0.f : bs[b + 1]); }, sums);
    for (int i = 0; i < M; ++i) out[i * n + row] = sums[i] * d[i];
  }
}
#endif

// int8 weights: w = code * scale. codes: [N, K] int8; scales: [N, K/g] float16 for groups of g (a multiple of
// 32; g = K: one scale per row).
at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales) {
  if (codes.dim() == 3) {
#if defined(KVSCOPE_AVX2)
    return int8_linear16(input, codes, scales);
#else
    TORCH_CHECK(false, "int8: the 16-row layout needs kernels built for AVX2 (int4_row_block() == 0)");
#endif
  }
  int64_t k = codes.size(1), n = codes.size(0);
  InputRows x = as_rows(input, k, n);
  int64_t m = x.m;
  int64_t groups = scales.size(1), g = k / groups;
  TORCH_CHECK(m <= MAX_ROWS, "int8_linear takes at most 16 rows");
  TORCH_CHECK(k % QK == 0 && g % QK == 0 && codes.size(1) == k, "int8: K and the group a multiple of 32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "contiguous weights");
  auto rows = quantize_rows(x.data, m, k);
  at::Tensor y = x.output;
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  parallel_chunks(n, grain_for(n), [&](int64_t n0, int64_t n1) {
    int64_t nb = k / QK, per = g / QK;
    std::vector<float> dw(groups), blocks(per > 1 ? nb : 0);  // a group's scale, then each block's (no division
#if defined(KVSCOPE_AVX512)                                    // in the kernel's loop)
    return in_row_groups(m, n0, n1, k, [&](int64_t r0, auto rows_m, int64_t u0, int64_t u1) {
      int8_rows<decltype(rows_m)::value>(c, sc, k, groups, per, rows, r0, out, u0, u1, n, dw.data(), blocks.data());
    });
#endif
    for (int64_t row = n0; row < n1; ++row) {
      prefetch_params(sc, nullptr, row + PARAMS_AHEAD, groups, n);
      halves_to_floats(sc + row * groups, dw.data(), groups);
      for (int64_t b = 0; per > 1 && b < nb; ++b) blocks[b] = dw[b / per];
      const float* block_scales = per > 1 ? blocks.data() : dw.data();
      with_rows(m, [&](auto rows_m) {
        int8_row<decltype(rows_m)::value>(c + row * k, block_scales, k, rows, m, out + row, n);
      });
    }
  });
  return y;
}

// rows `ids` of int8 weights (w = code * scale, a float16 scale per group of K / G) as float32: a decode step's
// embedding lookup in one call instead of the five tensor ops it takes in PyTorch (the same products, each
// rounded once). codes [N, K] int8 and scales [N, G] float16, or the 16-row layout's [N/16, K/32, 512] and
// [N/16, G, 16]; ids int64 [...] -> [..., K]
at::Tensor int8_embed(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids) {
  const bool rows16 = codes.dim() == 3;
  TORCH_CHECK((rows16 ? codes.size(2) == ROW_BLOCK * QK && scales.dim() == 3 && scales.size(2) == ROW_BLOCK
                      : codes.dim() == 2 && scales.dim() == 2) &&
                  codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf && codes.is_contiguous() &&
                  scales.is_contiguous() && scales.size(0) == codes.size(0),
              "int8_embed: int8 codes [N, K] and float16 scales [N, G] (or [N/16, K/32, 512] and [N/16, G, 16]), "
              "contiguous");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "int8_embed: ids must be int64");
  int64_t n = rows16 ? codes.size(0) * ROW_BLOCK : codes.size(0), k = rows16 ? codes.size(1) * QK : codes.size(1);
  int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0, "int8_embed: K must be a multiple of the scales' groups");
  int64_t g = k / groups;
  auto flat = ids.contiguous().view(-1);
  auto sizes = ids.sizes().vec();
  sizes.push_back(k);
  auto out = at::empty({flat.numel(), k}, codes.options().dtype(at::kFloat));
  const int64_t* id = flat.data_ptr<int64_t>();
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    int64_t r = id[i];
    TORCH_CHECK(r >= 0 && r < n, "int8_embed: row ", r, " is outside the ", n, " rows");
    // row r's code j and the scale of its group: in the 16-row layout block j / 32, byte 32 (j % 32 / 2) + 2 (r % 16) + j % 2
    int64_t gi = r / ROW_BLOCK, rr = r % ROW_BLOCK;
    auto code = [&](int64_t j) {
      if (!rows16) return c[r * k + j];
      return c[(gi * (k / QK) + j / QK) * ROW_BLOCK * QK + 32 * (j % QK / 2) + 2 * rr + j % 2];
    };
    auto scale = [&](int64_t j) {
      return half_to_float(rows16 ? sc[(gi * groups + j / g) * ROW_BLOCK + rr] : sc[r * groups + j / g]);
    };
    for (int64_t j = 0; j < k; ++j) o[i * k + j] = static_cast<float>(code(j)) * scale(j);
  }
  return out.view(sizes);
}

// ---------------------------------------------------------------- the small ops of a layer, fused
// rms norm of one row: x / sqrt(mean(x^2) + eps) * w, the squares (exact in double) summed in double: 16 at a
// time in four chains of four lanes, then the rest in order (one long chain was ~0.7 us of a 576-wide row's 1.7)
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t h, double eps) {
  double ss = 0.0;
  int64_t j = 0;
#ifdef KVSCOPE_AVX2
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; j + 16 <= h; j += 16)
    for (int a = 0; a < 4; ++a) {
      __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4 * a));
      acc[a] = _mm256_fmadd_pd(v, v, acc[a]);
    }
  __m256d both = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, both);
  ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; j < h; ++j) ss += static_cast<double>(x[j]) * x[j];
  float inv = static_cast<float>(1.0 / std::sqrt(ss / h + eps));
  for (int64_t c = 0; c < h; ++c) out[c] = x[c] * inv * w[c];
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.numel() == x.size(-1),
              "rms_norm takes contiguous float32 rows and a float32 weight of their size");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  int64_t h = x.size(-1), rows = x.numel() / h;
  auto y = fresh_tensor(x.sizes(), x.options());
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x.data_ptr<float>() + r * h, weight.data_ptr<float>(), y.data_ptr<float>() + r * h, h, eps);
  return y;
}

// the residual stream x += delta (in place), then its rms norm
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == at::kFloat,
              "delta: contiguous float32 of x's shape");
  int64_t h = x.size(-1), n = x.numel();
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) xp[j] += dp[j];
  auto y = fresh_tensor(x.sizes(), x.options());
  for (int64_t r = 0; r < n / h; ++r)
    rms_norm_row(xp + r * h, weight.data_ptr<float>(), y.data_ptr<float>() + r * h, h, eps);
  return y;
}

#ifdef KVSCOPE_AVX2
// exp (Cephes' polynomial): e^x = 2^n e^r, n = floor(x log2 e + 1/2), r = x - n ln 2 (ln 2 in two parts)
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HIGH = 0.693359375f, EXP_LN2_LOW = -2.12194440e-4f;
constexpr float EXP_POLY[] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                              4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

// exp on 8 lanes, inputs clamped to [-87, 88]
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_HIGH), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_LOW), x);
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int c = 1; c < 6; ++c) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[c]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

// gate_up: [..., 2I] (gate, then up) -> silu(gate) * up: [..., I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul takes contiguous float32 [..., 2I]");
  int64_t two = gate_up.size(-1), half = two / 2, rows = gate_up.numel() / two;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = half;
  auto out = fresh_tensor(sizes, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = src + r * two, *u = g + half;
    float* o = dst + r * half;
    int64_t j = 0;
#ifdef KVSCOPE_AVX2
    for (; j + 8 <= half; j += 8) {
      __m256 gv = _mm256_loadu_ps(g + j);
      __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < half; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
  }
  return out;
}

// qkv: [B * T, (Hq + 2 Hkv) * D] -> q [B, Hq, T, D], k [B, Hkv, T, D] with the rotary embedding, v [B, Hkv, T, D];
// cos, sin: [B, T, D]. Rotation: x * cos + (-x[D/2:], x[:D/2]) * sin.
std::vector<at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 3,
              "rope_qkv takes contiguous float32 qkv [B*T, (Hq+2Hkv)*D] and cos, sin [B, T, D]");
  int64_t b = cos.size(0), t = cos.size(1), d = cos.size(2), heads = hq + 2 * hkv, half = d / 2;
  TORCH_CHECK(qkv.numel() == b * t * heads * d, "qkv and cos disagree on B, T or D");
  auto opts = qkv.options();
  at::Tensor q = fresh_tensor({b, hq, t, d}, opts), k = fresh_tensor({b, hkv, t, d}, opts),
             v = fresh_tensor({b, hkv, t, d}, opts);
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti) {
      const float* row = src + (bi * t + ti) * heads * d;
      const float *c = cp + (bi * t + ti) * d, *s = sp + (bi * t + ti) * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = row + h * d;
        float* out = h < hq ? qp + ((bi * hq + h) * t + ti) * d
                   : h < hq + hkv ? kp + ((bi * hkv + h - hq) * t + ti) * d
                                  : vp + ((bi * hkv + h - hq - hkv) * t + ti) * d;
        if (h >= hq + hkv) {
          std::copy_n(x, d, out);
          continue;
        }
        for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] - x[j + half] * s[j];
        for (int64_t j = half; j < d; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
      }
    }
  return {q, k, v};
}

// ---------------------------------------------------------------- attention
// Keys and values live in "stores" (tensors [Hkv, slots, D]: a chunk of the paged pool, a contiguous
// reservation, a step's own keys). Token p of sequence b sits in store block_store[blk], slot
// block_start[blk] + p % block_size, for blk = table[b, p / block_size]. Query row t of sequence b (position
// q_pos[b, t]; -1: padding) attends to keys 0..q_pos in position order: scores, one softmax, weighted values,
// each summed in position order, so no layout, block size, batch or thread count changes a row's bits.

#ifdef KVSCOPE_AVX2
// exp for x <= 0 (scores minus their maximum); below -87 the result is 0
inline __m256 exp_nonpositive(__m256 x) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), exp8(x));
}
#ifdef KVSCOPE_AVX512
// exp8's steps, 16 lanes at a time (the same bits a lane); 0 below -87
inline __m512 exp_nonpositive16(__m512 x) {
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_HIGH), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_LOW), x);
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int c = 1; c < 6; ++c) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[c]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), y, _mm512_castsi512_ps(pow2));
}
#endif
#endif

// storage element -> float, 8 at a time
template <typename T> struct Load;
template <> struct Load<float> {
#ifdef KVSCOPE_AVX2
  static __m256 v8(const float* p) { return _mm256_loadu_ps(p); }
#endif
  static float one(const float* p) { return *p; }
};
template <> struct Load<c10::BFloat16> {
#ifdef KVSCOPE_AVX2
  static __m256 v8(const c10::BFloat16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
  static float one(const c10::BFloat16* p) { return static_cast<float>(*p); }
};
template <> struct Load<c10::Half> {
#ifdef KVSCOPE_AVX2
  static __m256 v8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
  static float one(const c10::Half* p) { return static_cast<float>(*p); }
};

// dot of a float query with a stored key of length d (a multiple of 8), in a fixed order
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
#ifdef KVSCOPE_AVX2
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), Load<T>::v8(k));
  for (int64_t j = 8; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), Load<T>::v8(k + j), acc);
  return hsum(acc);
#else
  float acc = 0.f;
  for (int64_t j = 0; j < d; ++j) acc += q[j] * Load<T>::one(k + j);
  return acc;
#endif
}


// out[0..d) += w * v, in place
template <typename T>
inline void axpy(float w, const T* v, float* out, int64_t d) {
#ifdef KVSCOPE_AVX2
  __m256 wv = _mm256_set1_ps(w);
  for (int64_t j = 0; j < d; j += 8)
    _mm256_storeu_ps(out + j, _mm256_fmadd_ps(wv, Load<T>::v8(v + j), _mm256_loadu_ps(out + j)));
#else
  for (int64_t j = 0; j < d; ++j) out[j] += w * Load<T>::one(v + j);
#endif
}

// ---------------------------------------------------------------- float32 / bfloat16 weights
// sums[r] = w . xs[r] for R activation rows sharing each load of the weight row. A row sums over four
// accumulators (lanes j..j+7 of every 32 values into accumulator j / 8 % 4, a tail of 8s into the first), then
// (a0 + a1) + (a2 + a3) and the lanes: the same operations for a row whatever R, so its bits do not depend on
// the rows beside it, and four chains keep the FMA unit busy where one waited for each result.
template <int R, typename T>
inline void weight_row_dots(const float* const* xs, const T* w, int64_t k, float* sums) {
#ifdef KVSCOPE_AVX2
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < 4; ++a) acc[r][a] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32)
    for (int a = 0; a < 4; ++a) {
      __m256 wv = Load<T>::v8(w + j + 8 * a);
      for (int r = 0; r < R; ++r) acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + j + 8 * a), wv, acc[r][a]);
    }
  for (; j < k; j += 8) {
    __m256 wv = Load<T>::v8(w + j);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + j), wv, acc[r][0]);
  }
  for (int r = 0; r < R; ++r)
    sums[r] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) acc = std::fma(xs[r][j], Load<T>::one(w + j), acc);
    sums[r] = acc;
  }
#endif
}

constexpr int FLOAT_ROWS = 3;  // activation rows a weight row's loads serve at once (their accumulators: 12 registers)

// y[m, n] = w[n] . x[m]
template <typename T>
void float_linear_impl(const InputRows& x, const at::Tensor& w) {
  int64_t m = x.m, k = w.size(1), n = w.size(0);
  const float* xp = x.data;
  const T* wp = w.data_ptr<T>();
  float* out = x.output.data_ptr<float>();
  parallel_chunks(n, grain_for(n), [&](int64_t n0, int64_t n1) {
    for (int64_t row = n0; row < n1; ++row) {
      const T* wrow = wp + row * k;
      for (int64_t i = 0; i < m; i += FLOAT_ROWS) {
        const float* xs[FLOAT_ROWS];
        float sums[FLOAT_ROWS];
        int64_t r = std::min<int64_t>(FLOAT_ROWS, m - i);
        for (int64_t q = 0; q < r; ++q) xs[q] = xp + (i + q) * k;
        if (r == 3) weight_row_dots<3>(xs, wrow, k, sums);
        else if (r == 2) weight_row_dots<2>(xs, wrow, k, sums);
        else weight_row_dots<1>(xs, wrow, k, sums);
        for (int64_t q = 0; q < r; ++q) out[(i + q) * n + row] = sums[q];
      }
    }
  });
}

at::Tensor float_linear(const at::Tensor& input, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % 8 == 0, "w must be [N, K] contiguous, K % 8 == 0");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  InputRows x = as_rows(input, w.size(1), w.size(0));
  if (w.scalar_type() == at::kFloat) float_linear_impl<float>(x, w);
  else float_linear_impl<c10::BFloat16>(x, w);
  return x.output;
}

// softmax weights of one row in place: e[p] = exp(s[p] - mx) for p <= last, 0 after; returns their sum
inline float softmax_row(float* s, int64_t last, int64_t padded, float mx) {
  for (int64_t p = last + 1; p < padded; ++p) s[p] = -std::numeric_limits<float>::infinity();
#ifdef KVSCOPE_AVX2
  __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(mx);
  int64_t p = 0;
#ifdef KVSCOPE_AVX512
  __m512 mv16 = _mm512_set1_ps(mx);
  for (; p + 16 <= padded; p += 16) {  // summed 8 lanes at a time as below: zeros past `last` change no bit
    __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mv16));
    _mm512_storeu_ps(s + p, e);
    sum = _mm256_add_ps(_mm256_add_ps(sum, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (; p < padded; p += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), mv));
    _mm256_storeu_ps(s + p, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
#else
  float sum = 0.f;
  for (int64_t p = 0; p < padded; ++p) {
    s[p] = p <= last ? std::exp(s[p] - mx) : 0.f;
    sum += s[p];
  }
  return sum;
#endif
}

// Rows of keys or values [D] as stored (float32, bfloat16 or float16), read in place.
template <typename T>
struct StoreRows {
  using Element = T;
  int64_t first = 0;  // the position of at[0]
  const T* const* at = nullptr;  // per position from `first` (in the thread's scratch until its next tile)
};

// Attention over fixed key tiles: the keys of positions [t * KEY_TILE, (t + 1) * KEY_TILE) form tile t, whatever
// the layout. A task attends a group of query rows over one tile and leaves a partial result (the tile's
// maximum score, the sum of exp(score - maximum), and the values weighted by those exponentials, each summed in
// position order); the partials of a row are then combined in tile order. Tiles are positions, not blocks:
// neither the block size, the pool's chunks, the batch nor the number of threads changes a row's bits.
constexpr int64_t KEY_TILE = 256;

// rows * group query vectors q ([nq, D], row r head j at r * group + j, already scaled) at positions pos[r]
// attend to the keys k0..min(k1, pos[r] + 1) - 1; per vector: max -> part[0], sum -> part[1], values -> part[2..]
inline void prefetch_row(const void* key, const void* value, int64_t bytes) {
#ifdef KVSCOPE_AVX2
  for (int64_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(key) + off, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(value) + off, _MM_HINT_T1);
  }
#endif
}

// lines to prefetch into L1, issued a few at a time between a block's computations: int8's whole block of lines at
// once (19 and more) would fill the line fill buffers and stall the loads behind them
struct Prefetches {
  static constexpr int MAX = 128;
  std::array<const char*, MAX> line{};
  int n = 0, next = 0;
  void add(const void* from, const void* to) {  // the count in a register (a member's store and reload a line)
    int k = n;
    for (const char* p = line_of(from); p < static_cast<const char*>(to) && k < MAX; p += 64) line[k++] = p;
    n = k;
  }
  void issue(int count) {
#ifdef KVSCOPE_AVX2
    int k = next, end = std::min(n, next + count);
    for (; k < end; ++k) _mm_prefetch(line[k], _MM_HINT_T0);
    next = k;
#endif
  }
  int left() const { return n - next; }
  void clear() { n = next = 0; }
};

#ifdef KVSCOPE_AVX2
// the lane sums of four accumulators -> [sum a0, sum a1, sum a2, sum a3]
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// scores of one query against keys 0..n-1 (rows k), four keys at a time; a last group of fewer than four reads
// its last key again in the missing places and drops those scores, so every score is reduced the same way
// (keys stored as T are converted 8 at a time in registers: exact, so the bits are those of float32 rows)
template <typename T>
inline void score_keys(const float* q, const T* const* k, int64_t n, int64_t d, float* out) {
#ifdef KVSCOPE_AVX2
  for (int64_t p = 0; p < n; p += 4) {
    const T* r[4];
    for (int64_t j = 0; j < 4; ++j) r[j] = k[std::min(p + j, n - 1)];
    __m256 q0 = _mm256_loadu_ps(q);
    __m256 a0 = _mm256_mul_ps(q0, Load<T>::v8(r[0])), a1 = _mm256_mul_ps(q0, Load<T>::v8(r[1]));
    __m256 a2 = _mm256_mul_ps(q0, Load<T>::v8(r[2])), a3 = _mm256_mul_ps(q0, Load<T>::v8(r[3]));
    for (int64_t j = 8; j < d; j += 8) {
      __m256 qj = _mm256_loadu_ps(q + j);
      a0 = _mm256_fmadd_ps(qj, Load<T>::v8(r[0] + j), a0);
      a1 = _mm256_fmadd_ps(qj, Load<T>::v8(r[1] + j), a1);
      a2 = _mm256_fmadd_ps(qj, Load<T>::v8(r[2] + j), a2);
      a3 = _mm256_fmadd_ps(qj, Load<T>::v8(r[3] + j), a3);
    }
    alignas(16) float four[4];
    _mm_store_ps(four, hsum4(a0, a1, a2, a3));
    for (int64_t j = 0; j < 4 && p + j < n; ++j) out[p + j] = four[j];
  }
#else
  for (int64_t p = 0; p < n; ++p) out[p] = dot<T>(q, k[p], d);
#endif
}

// out[0..d) += sum over p < n of e[p] * v[p], in position order per lane; D/8 accumulators in registers for D 64
template <int D8, typename T>
inline void weigh_values_fixed(const float* e, const T* const* v, int64_t n, float* out) {
#ifdef KVSCOPE_AVX2
  __m256 acc[D8];
  for (int j = 0; j < D8; ++j) acc[j] = _mm256_loadu_ps(out + 8 * j);
  for (int64_t p = 0; p < n; ++p) {
    __m256 w = _mm256_set1_ps(e[p]);
    for (int j = 0; j < D8; ++j) acc[j] = _mm256_fmadd_ps(w, Load<T>::v8(v[p] + 8 * j), acc[j]);
  }
  for (int j = 0; j < D8; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
#else
  for (int64_t p = 0; p < n; ++p) axpy<T>(e[p], v[p], out, D8 * 8);
#endif
}

template <typename T>
inline void weigh_values(const float* e, const T* const* v, int64_t n, float* out, int64_t d) {
  if (d == 64) return weigh_values_fixed<8>(e, v, n, out);
  if (d == 128) return weigh_values_fixed<16>(e, v, n, out);
  for (int64_t p = 0; p < n; ++p) axpy<T>(e[p], v[p], out, d);
}

#ifdef KVSCOPE_AVX2
#ifdef __AVX512F__
constexpr int VECTOR_REGISTERS = 32;  // ymm0-31 where AVX-512 VL is built
#else
constexpr int VECTOR_REGISTERS = 16;
#endif

// score_keys for NV query vectors that see the same keys (one KV head's group at one position): four keys at a
// time, each key's 8 channels loaded and converted once for all NV vectors, and the vectors' 8 channels loaded once
// for the four keys (channels outer, keys inner: NV x 4 accumulators, NV query registers and one key register; the
// keys outer, with the query reloaded for every key, took 2.4x the cycles standalone on a Zen 3); every score is
// summed exactly as score_keys sums it (the same bits: a key's sum is the same whichever keys share its hsum4).
// q[v]: the vectors; k: n <= 4 key rows (a last group of fewer reads its last key again); out[v]: where vector v's
// n scores go
template <typename T, int NV>
inline void score_four_keys(const float* const* q, const T* const* k, int64_t n, int64_t d, float* const* out) {
  static_assert(NV * 5 + 1 <= VECTOR_REGISTERS, "NV x 4 accumulators, NV query registers and a key");
  for (int64_t k0 = 0; k0 < n; k0 += 4) {
    const T* r[4];
    for (int64_t j = 0; j < 4; ++j) r[j] = k[std::min<int64_t>(k0 + j, n - 1)];
    __m256 acc[NV][4];
    for (int64_t c = 0; c < d; c += 8) {
      __m256 qv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(q[v] + c);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256 key = Load<T>::v8(r[j] + c);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[v][j] = c == 0 ? _mm256_mul_ps(qv[v], key) : _mm256_fmadd_ps(qv[v], key, acc[v][j]);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __m128 sums = hsum4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
      if (n - k0 >= 4) {
        _mm_storeu_ps(out[v] + k0, sums);
        continue;
      }
      alignas(16) float four[4];
      _mm_store_ps(four, sums);
      for (int64_t j = 0; k0 + j < n; ++j) out[v][k0 + j] = four[j];
    }
  }
}

// weigh_values for NV vectors over the same n value rows: out_v[0..d) += sum over p of e_v[p] * v[p], each row
// loaded and converted once for all of them, 32 channels at a time with the row's NV weights held in registers: NV x 4
// accumulators (12 for three vectors: enough independent chains for two FMAs a cycle, where the 16 channels at a time
// this replaced had 6 chains waiting on the FMA's latency: 3-4% of a step at 4,096 tokens on a Zen 3), NV weights and
// a row register; every sum in weigh_values' order (same bits)
template <typename T, int NV>
inline void weigh_rows(const float* const* e, const T* const* v, int64_t n, float* const* out, int64_t d) {
  static_assert(NV * 5 + 1 <= VECTOR_REGISTERS, "NV x 4 accumulators, NV weights and a row");
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    __m256 acc[NV][4];
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[u][j] = _mm256_loadu_ps(out[u] + c + 8 * j);
    for (int64_t p = 0; p < n; ++p) {
      __m256 w[NV];
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) w[u] = _mm256_set1_ps(e[u][p]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256 row = Load<T>::v8(v[p] + c + 8 * j);
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) acc[u][j] = _mm256_fmadd_ps(w[u], row, acc[u][j]);
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out[u] + c + 8 * j, acc[u][j]);
  }
  for (; c < d; c += 8) {
    __m256 acc[NV];
    for (int u = 0; u < NV; ++u) acc[u] = _mm256_loadu_ps(out[u] + c);
    for (int64_t p = 0; p < n; ++p) {
      __m256 v0 = Load<T>::v8(v[p] + c);
      for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(e[u][p]), v0, acc[u]);
    }
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(out[u] + c, acc[u]);
  }
}
#endif

#ifdef KVSCOPE_AVX512
// ---- the float attention 16 lanes a register (AVX-512): key and value rows are read 32 channels at a time.
// bfloat16 rows widen in place: a 32-bit lane holds channels 2i and 2i + 1, so one shift gives the even channels
// as floats and one mask the odd ones; the query is put in that order once per tile (`in_key_order`) and the
// weighted values are put back in channel order where they are stored. Every sum keeps one fixed order.
inline bool float512(int64_t d) { return d % 32 == 0; }

template <typename T> struct Load32;  // 32 stored channels -> two registers (a, b)
template <> struct Load32<float> {
  static constexpr bool PAIRED = false;  // a: channels 0-15, b: 16-31
  static void two(const float* p, __m512& a, __m512& b) { a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16); }
};
template <> struct Load32<c10::Half> {
  static constexpr bool PAIRED = false;
  static void two(const c10::Half* p, __m512& a, __m512& b) {
    auto half16 = [](const c10::Half* h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)); };
    a = _mm512_cvtph_ps(half16(p)), b = _mm512_cvtph_ps(half16(p + 16));
  }
};
template <> struct Load32<c10::BFloat16> {
  static constexpr bool PAIRED = true;  // a: channels 0, 2, .., 30; b: 1, 3, .., 31
  static void two(const c10::BFloat16* p, __m512& a, __m512& b) {
    __m512i x = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// 32 lanes of two registers (x, y) in another order: a = lanes `index` of (x, y), b = lanes index + step
inline void reorder32(__m512 x, __m512 y, __m512i index, int step, __m512& a, __m512& b) {
  a = _mm512_permutex2var_ps(x, index, y);
  b = _mm512_permutex2var_ps(x, _mm512_add_epi32(index, _mm512_set1_epi32(step)), y);
}

// 32 channels in order (x0: 0-15, x1: 16-31) <-> paired (a: even channels, b: odd ones)
inline void to_pairs(__m512 x0, __m512 x1, __m512& a, __m512& b) {
  reorder32(x0, x1, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), 1, a, b);
}
inline void from_pairs(__m512 a, __m512 b, __m512& x0, __m512& x1) {
  reorder32(a, b, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), 8, x0, x1);
}

// the horizontal maxima (MAX) or sums of four registers -> lanes 0..3, in one fixed order
template <bool MAX>
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto op = [](__m512 x, __m512 y) { return MAX ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y); };
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  __m512 t0 = op(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));  // a 128-bit lane: a0 a1 a0 a1
  __m512 t1 = op(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));  // a2 a3 a2 a3
  __m512 u = op(_mm512_castpd_ps(_mm512_unpacklo_pd(pd(t0), pd(t1))),
                _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t0), pd(t1))));  // a0 a1 a2 a3
  u = op(u, _mm512_shuffle_f32x4(u, u, 0x4E));
  return _mm512_castps512_ps128(op(u, _mm512_shuffle_f32x4(u, u, 0xB1)));
}

// nq query vectors [nq, D] in the channel order Load32<T> reads keys in (a copy where it differs)
template <typename T>
inline const float* in_key_order(const float* q, int64_t nq, int64_t d) {
  if constexpr (!Load32<T>::PAIRED) {
    return q;
  } else {
    thread_local std::vector<float> paired;
    paired.resize(nq * d);
    for (int64_t c = 0; c < nq * d; c += 32) {
      __m512 a, b;
      to_pairs(_mm512_loadu_ps(q + c), _mm512_loadu_ps(q + c + 16), a, b);
      _mm512_storeu_ps(paired.data() + c, a), _mm512_storeu_ps(paired.data() + c + 16, b);
    }
    return paired.data();
  }
}

// score_four_keys 16 lanes at a time: NV vectors q[v] (in key order) against n <= 4 key rows k; D32: d / 32 where
// known when compiled, else 0. Called per four keys, so inlined by request with its callers (out of line, a call
// and its arguments through the stack per four keys cost the float attention 3-15%)
template <typename T, int NV, int D32>
__attribute__((always_inline)) inline void score_four_keys_512(const float* const* q, const T* const* k, int64_t n,
                                                               int64_t d_, float* const* out) {
  const int64_t d = D32 ? D32 * 32 : d_;
  const T* r[4];
  for (int64_t j = 0; j < 4; ++j) r[j] = k[std::min<int64_t>(j, n - 1)];
  __m512 acc[NV][4];
  for (int64_t c = 0; c < d; c += 32) {
    __m512 a[4], b[4];
    for (int j = 0; j < 4; ++j) Load32<T>::two(r[j] + c, a[j], b[j]);
    for (int v = 0; v < NV; ++v) {
      __m512 qa = _mm512_loadu_ps(q[v] + c), qb = _mm512_loadu_ps(q[v] + c + 16);
      for (int j = 0; j < 4; ++j)
        acc[v][j] = _mm512_fmadd_ps(qb, b[j], c == 0 ? _mm512_mul_ps(qa, a[j]) : _mm512_fmadd_ps(qa, a[j], acc[v][j]));
    }
  }
  const __mmask8 keep = static_cast<__mmask8>((1u << n) - 1);
  for (int v = 0; v < NV; ++v)
    _mm_mask_storeu_ps(out[v], keep, reduce4<false>(acc[v][0], acc[v][1], acc[v][2], acc[v][3]));
}

template <typename T, int NV>
__attribute__((always_inline)) inline void score_four_keys_512(const float* const* q, const T* const* k, int64_t n,
                                                               int64_t d, float* const* out) {
  if (d == 64) return score_four_keys_512<T, NV, 2>(q, k, n, d, out);
  if (d == 128) return score_four_keys_512<T, NV, 4>(q, k, n, d, out);
  score_four_keys_512<T, NV, 0>(q, k, n, d, out);
}

// weigh_rows 16 lanes at a time, C (1 or 2) groups of 32 channels from c: out_v[c..) += sum over p of e_v[p] * v[p]
template <typename T, int NV, int C>
inline void weigh_rows_512(const float* const* e, const T* const* v, int64_t n, float* const* out, int64_t c) {
  __m512 acc[NV][2 * C];
  for (int u = 0; u < NV; ++u)
    for (int g = 0; g < C; ++g) {
      __m512 x0 = _mm512_loadu_ps(out[u] + c + 32 * g), x1 = _mm512_loadu_ps(out[u] + c + 32 * g + 16);
      if constexpr (Load32<T>::PAIRED) to_pairs(x0, x1, acc[u][2 * g], acc[u][2 * g + 1]);
      else acc[u][2 * g] = x0, acc[u][2 * g + 1] = x1;
    }
  for (int64_t p = 0; p < n; ++p) {
    __m512 x[2 * C];
    for (int g = 0; g < C; ++g) Load32<T>::two(v[p] + c + 32 * g, x[2 * g], x[2 * g + 1]);
    for (int u = 0; u < NV; ++u) {
      __m512 w = _mm512_set1_ps(e[u][p]);
      for (int j = 0; j < 2 * C; ++j) acc[u][j] = _mm512_fmadd_ps(w, x[j], acc[u][j]);
    }
  }
  for (int u = 0; u < NV; ++u)
    for (int g = 0; g < C; ++g) {
      __m512 x0 = acc[u][2 * g], x1 = acc[u][2 * g + 1];
      if constexpr (Load32<T>::PAIRED) from_pairs(acc[u][2 * g], acc[u][2 * g + 1], x0, x1);
      _mm512_storeu_ps(out[u] + c + 32 * g, x0), _mm512_storeu_ps(out[u] + c + 32 * g + 16, x1);
    }
}

template <typename T, int NV>
inline void weigh_rows_512(const float* const* e, const T* const* v, int64_t n, float* const* out, int64_t d) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weigh_rows_512<T, NV, 2>(e, v, n, out, c);
  if (c < d) weigh_rows_512<T, NV, 1>(e, v, n, out, c);
}

#ifdef __AVX512BF16__
#define KVSCOPE_BF16_DOTS 1
// ---- bfloat16 stores by vdpbf16ps: a 32-bit lane sums the products of two bfloat16 pairs in one instruction, so
// the stored rows need no widening and the sums half the float path's FMAs. Keys: the query is rounded to
// bfloat16 once per tile (as the stored keys were; with the weights below, the mean KL of a bfloat16 cache against a
// float32 one went 0.000033 -> 0.000049 nats on tests/test_kv_precision.py's English), a lane sums channels 2i and
// 2i + 1, then the lanes in reduce4's order (one attention layer of 4,096 tokens: 0.88x the time of the float
// path's FMAs from the caches, 0.95x from memory). Values: two tokens' rows
// interleaved channel by channel (vpunpck{l,h}wd: per 128-bit lane, channels 0-3 then 4-7 of its 8) meet the pair of
// their softmax weights, rounded to bfloat16 (a last odd token beside a weight of 0); the sums are put back in
// channel order where they are stored. Every sum keeps one fixed order, pairs at even positions.
inline __m512bh bf16_32(const void* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

// x[0..n) rounded to bfloat16 -> out, 32 at a time (zeros from n to the next multiple of 32)
inline void round_to_bf16(const float* x, int64_t n, c10::BFloat16* out) {
  for (int64_t p = 0; p < n; p += 32) {
    auto part = [&](int64_t at) {
      int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, n - at));
      return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), x + at);
    };
    _mm512_storeu_si512(out + p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(part(p + 16), part(p))));
  }
}

// nq query vectors [nq, D] float -> bfloat16, vector i in the first half of its d floats (the callers' strides)
inline const float* bf16_query(const float* q, int64_t nq, int64_t d) {
  thread_local std::vector<float> rounded;
  rounded.resize(nq * d);
  for (int64_t i = 0; i < nq; ++i) round_to_bf16(q + i * d, d, reinterpret_cast<c10::BFloat16*>(rounded.data() + i * d));
  return rounded.data();
}

// score_four_keys_512 for bfloat16 keys: NV bfloat16 vectors (bf16_query's slots) against n <= 4 key rows
template <int NV, int D32>
__attribute__((always_inline)) inline void score_four_keys_bf16(const float* const* q, const c10::BFloat16* const* k,
                                                                int64_t n, int64_t d_, float* const* out) {
  const int64_t d = D32 ? D32 * 32 : d_;
  const c10::BFloat16* r[4];
  for (int64_t j = 0; j < 4; ++j) r[j] = k[std::min<int64_t>(j, n - 1)];
  __m512 acc[NV][4];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512bh kj[4];
    for (int j = 0; j < 4; ++j) kj[j] = bf16_32(r[j] + c);
    for (int v = 0; v < NV; ++v) {
      __m512bh qv = bf16_32(reinterpret_cast<const c10::BFloat16*>(q[v]) + c);
      for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], qv, kj[j]);
    }
  }
  const __mmask8 keep = static_cast<__mmask8>((1u << n) - 1);
  for (int v = 0; v < NV; ++v)
    _mm_mask_storeu_ps(out[v], keep, reduce4<false>(acc[v][0], acc[v][1], acc[v][2], acc[v][3]));
}

template <int NV>
__attribute__((always_inline)) inline void score_four_keys_bf16(const float* const* q, const c10::BFloat16* const* k,
                                                                int64_t n, int64_t d, float* const* out) {
  if (d == 64) return score_four_keys_bf16<NV, 2>(q, k, n, d, out);
  if (d == 128) return score_four_keys_bf16<NV, 4>(q, k, n, d, out);
  score_four_keys_bf16<NV, 0>(q, k, n, d, out);
}

// 32 channels in order (x0: 0-15, x1: 16-31) <-> vpunpck{l,h}wd's (lo: 0-3, 8-11, 16-19, 24-27; hi: the others)
inline void to_word_pairs(__m512 x0, __m512 x1, __m512& lo, __m512& hi) {
  reorder32(x0, x1, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), 4, lo, hi);
}
inline void from_word_pairs(__m512 lo, __m512 hi, __m512& x0, __m512& x1) {
  reorder32(lo, hi, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), 8, x0, x1);
}

// weigh_rows_512 for bfloat16 values, C (1 or 2) groups of 32 channels from c; w[u]: vector u's weights as
// bfloat16, n rounded up to even (a 0 after an odd last)
template <int NV, int C>
inline void weigh_rows_bf16(const c10::BFloat16* const* w, const c10::BFloat16* const* v, int64_t n,
                            float* const* out, int64_t c) {
  __m512 acc[NV][2 * C];
  for (int u = 0; u < NV; ++u)
    for (int g = 0; g < C; ++g)
      to_word_pairs(_mm512_loadu_ps(out[u] + c + 32 * g), _mm512_loadu_ps(out[u] + c + 32 * g + 16),
                    acc[u][2 * g], acc[u][2 * g + 1]);
  for (int64_t p = 0; p < n; p += 2) {
    const c10::BFloat16* a = v[p] + c;
    const c10::BFloat16* b = v[std::min(p + 1, n - 1)] + c;
    __m512bh x[2 * C];
    for (int g = 0; g < C; ++g) {
      __m512i ra = _mm512_loadu_si512(a + 32 * g), rb = _mm512_loadu_si512(b + 32 * g);
      x[2 * g] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(ra, rb));
      x[2 * g + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(ra, rb));
    }
    for (int u = 0; u < NV; ++u) {
      int32_t pair;
      std::memcpy(&pair, w[u] + p, sizeof(pair));
      __m512bh wp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < 2 * C; ++j) acc[u][j] = _mm512_dpbf16_ps(acc[u][j], wp, x[j]);
    }
  }
  for (int u = 0; u < NV; ++u)
    for (int g = 0; g < C; ++g) {
      __m512 x0, x1;
      from_word_pairs(acc[u][2 * g], acc[u][2 * g + 1], x0, x1);
      _mm512_storeu_ps(out[u] + c + 32 * g, x0), _mm512_storeu_ps(out[u] + c + 32 * g + 16, x1);
    }
}

// NV vectors' float weights e[u][0..n) -> bfloat16 in scratch (a 0 after an odd n), then weigh_rows_bf16
template <int NV>
inline void weigh_rows_bf16(const float* const* e, const c10::BFloat16* const* v, int64_t n, float* const* out,
                            int64_t d) {
  thread_local std::vector<c10::BFloat16> scratch;
  const int64_t even = (n + 1) / 2 * 2, stride = (even + 31) / 32 * 32;
  scratch.resize(NV * stride);
  const c10::BFloat16* w[NV];
  for (int u = 0; u < NV; ++u) {
    c10::BFloat16* wu = scratch.data() + u * stride;
    round_to_bf16(e[u], n, wu);  // (even and n round up to the same multiple of 32)
    w[u] = wu;
  }
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weigh_rows_bf16<NV, 2>(w, v, n, out, c);
  if (c < d) weigh_rows_bf16<NV, 1>(w, v, n, out, c);
}
#endif
#endif

#ifdef KVSCOPE_AVX512
// the query as the 16-lane score kernels for keys stored as T read it
template <typename T>
inline const float* query_for(const float* q, int64_t nq, int64_t d) {
#ifdef KVSCOPE_BF16_DOTS
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_query(q, nq, d);
#endif
  return in_key_order<T>(q, nq, d);
}
#endif

// f(first, std::integral_constant<int, NV>) for vectors 0..count-1, three at a time (NV = 3, 2 or 1)
template <typename F>
__attribute__((always_inline)) inline void in_threes(int64_t count, F f) {
  for (int64_t a = 0; a < count; a += 3) {
    int64_t nv = std::min<int64_t>(3, count - a);
    if (nv == 3) f(a, std::integral_constant<int, 3>{});
    if (nv == 2) f(a, std::integral_constant<int, 2>{});
    if (nv == 1) f(a, std::integral_constant<int, 1>{});
  }
}

// Query vectors 0..count-1 of a tile's task that share their keys (one query row's group of heads, at one
// position; in_key_order's channel order where it applies): their scores against n <= 4 keys k (each vector's
// scores `padded` apart)
template <typename T>
__attribute__((always_inline)) inline void score_group(const float* q, int64_t count, int64_t d, const T* const* k,
                                                       int64_t n, float* scores, int64_t padded) {
#ifdef KVSCOPE_AVX2
  in_threes(count, [&](int64_t a, auto nv) {
    constexpr int NV = decltype(nv)::value;
    const float* qv[NV];
    float* out[NV];
    for (int u = 0; u < NV; ++u) qv[u] = q + (a + u) * d, out[u] = scores + (a + u) * padded;
#ifdef KVSCOPE_BF16_DOTS
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (float512(d)) return score_four_keys_bf16<NV>(qv, k, n, d, out);
#endif
#ifdef KVSCOPE_AVX512
    if (float512(d)) return score_four_keys_512<T, NV>(qv, k, n, d, out);
#endif
    score_four_keys<T, NV>(qv, k, n, d, out);
  });
#else
  for (int64_t a = 0; a < count; ++a) score_keys(q + a * d, k, n, d, scores + a * padded);
#endif
}

// and their softmax weights e (`padded` apart) times n value rows v into their partials (`stride` apart)
template <typename T>
inline void weigh_group(const float* e, int64_t padded, int64_t count, const T* const* v, int64_t n, float* part,
                        int64_t stride, int64_t d) {
#ifdef KVSCOPE_AVX2
  in_threes(count, [&](int64_t a, auto nv) {
    constexpr int NV = decltype(nv)::value;
    const float* ev[NV];
    float* out[NV];
    for (int u = 0; u < NV; ++u) ev[u] = e + (a + u) * padded, out[u] = part + (a + u) * stride;
#ifdef KVSCOPE_BF16_DOTS
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (float512(d)) return weigh_rows_bf16<NV>(ev, v, n, out, d);
#endif
#ifdef KVSCOPE_AVX512
    if (float512(d)) return weigh_rows_512<T, NV>(ev, v, n, out, d);
#endif
    weigh_rows<T, NV>(ev, v, n, out, d);
  });
#else
  for (int64_t a = 0; a < count; ++a) weigh_values(e + a * padded, v, n, part + a * stride, d);
#endif
}

// the largest of s[0..n), n >= 1 (max is exact, so any order gives std::max_element's value)
inline float row_max(const float* s, int64_t n) {
  float mx = s[0];
  int64_t p = 0;
#ifdef KVSCOPE_AVX512
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(s);
    for (p = 16; p + 16 <= n; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
    mx = _mm512_reduce_max_ps(m);
  }
#endif
#ifdef KVSCOPE_AVX2
  if (n >= 8 && p == 0) {
    __m256 m = _mm256_loadu_ps(s);
    for (p = 8; p + 8 <= n; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + p));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    mx = *std::max_element(lanes, lanes + 8);
  }
#endif
  for (; p < n; ++p) mx = std::max(mx, s[p]);
  return mx;
}

// each vector's partial: its maximum score, the softmax weights in place of its scores (and their sum), and
// zeroed values to accumulate into; a vector with no key in the tile (last < 0) keeps -inf and 0
inline void start_partials(float* part, float* scores, const int64_t* last, int64_t nq, int64_t padded, int64_t d) {
  for (int64_t i = 0; i < nq; ++i) {
    float* pi = part + i * (d + 2);
    pi[0] = -std::numeric_limits<float>::infinity();
    pi[1] = 0.f;
    std::fill_n(pi + 2, d, 0.f);
    if (last[i] < 0) continue;
    float* si = scores + i * padded;
    pi[0] = row_max(si, last[i] + 1);
    pi[1] = softmax_row(si, last[i], padded, pi[0]);
  }
}

template <typename K, typename V>
void attend_tile(const float* q, float* part, const K& keys, const V& values, const int32_t* pos, int64_t rows,
                 int64_t group, int64_t d, int64_t k0, int64_t k1) {
  // rows kept in L1 while every query vector uses them; one query row (a decode step) weighs a tile's values in
  // one pass (its accumulators stored and reloaded fewer times; the same sums in the same order either way)
  constexpr int64_t KEYS_AT_ONCE = 4;
  const int64_t VALUES_AT_ONCE = rows == 1 ? KEY_TILE : 32;
  using TK = typename K::Element;
  using TV = typename V::Element;
  int64_t n = k1 - k0, padded = (n + 7) / 8 * 8, nq = rows * group, stride = d + 2;
  const TK* const* rows_k = keys.at + (k0 - keys.first);  // the stored rows, read in place in their own type
  const TV* const* rows_v = values.at + (k0 - values.first);
  thread_local std::vector<float> scores;
  scores.resize(nq * padded);  // every score up to a vector's last key is written, the rest set by its softmax
  std::vector<int64_t> last(nq);  // each vector's last key in this tile, from k0
  for (int64_t i = 0; i < nq; ++i) last[i] = std::min<int64_t>(pos[i / group], k1 - 1) - k0;
#ifdef KVSCOPE_AVX512
  if (float512(d)) q = query_for<TK>(q, nq, d);
#endif
  // the tile's first rows at once (this VM's hardware prefetchers barely help: without the software prefetches
  // the bfloat16 attention at 4,096 tokens takes 16.5 ms instead of 10.6), then a few at a time, ahead of their
  // use: the next keys into L1, the values at the same pace into L2 (read after the softmax)
  for (int64_t a = 0; a < std::min(n, 4 * KEYS_AT_ONCE); ++a)
    prefetch_row(rows_k[a], rows_v[a], d * static_cast<int64_t>(sizeof(TK)));
  for (int64_t p = 0; p < n; p += KEYS_AT_ONCE) {
    for (int64_t a = p + 4 * KEYS_AT_ONCE; a < std::min(n, p + 5 * KEYS_AT_ONCE); ++a)
      prefetch_row(rows_k[a], rows_v[a], d * static_cast<int64_t>(sizeof(TK)));
    for (int64_t r = 0; r < rows; ++r)  // a row's group of vectors shares its position, so its keys
      if (p <= last[r * group])
        score_group(q + r * group * d, group, d, rows_k + p, std::min(KEYS_AT_ONCE, last[r * group] + 1 - p),
                    scores.data() + r * group * padded + p, padded);
  }
  start_partials(part, scores.data(), last.data(), nq, padded, d);
  for (int64_t p = 0; p < n; p += VALUES_AT_ONCE)
    for (int64_t r = 0; r < rows; ++r)
      if (p <= last[r * group])
        weigh_group(scores.data() + r * group * padded + p, padded, group, rows_v + p,
                    std::min(VALUES_AT_ONCE, last[r * group] + 1 - p), part + r * group * stride + 2, stride, d);
}

// ---------------------------------------------------------------- quantized KV: int8 and int4 codes with scales
// int8 (symmetric): x = code * scale, code in -127..127. int4 (asymmetric, KIVI-style): x = code * scale + min,
// code in 0..15, two codes a byte (byte j holds channel j in its low nibble and channel j + D/2 in its high one).
// Keys: a scale (int4: and a minimum) per channel over the tokens of one block, since a few channels of the keys
// carry outliers and per-channel groups keep them from spoiling the others; values: per token and head.
// A sequence's newest tokens stay in full precision in its window (int4: float16), a ring of W rows (position p in row
// p % W): a block is quantized when the sequence has `residual` more tokens after it (KIVI's full-precision
// residual; 0: when the block fills), and only from the sequence's boundary `upto` on (blocks below it hold
// their codes already, maybe shared with other sequences). The quantized positions are [0, full) with
// full = max(upto, floor((kv_len - residual) / block_size) * block_size); the window holds [full, kv_len).
// The first `sink` positions are also kept in full precision, in the sequence's sink rows, and read from there
// (the first tokens draw much of every query's attention: an attention sink, as StreamingLLM calls them).
// Attention reads the codes in place: a block's key scales fold into the query (q * scale, plus q . min), a
// token's value scale into its softmax weight; a block's codes become floats once, in a small scratch that
// every query vector of the tile reads, never a float copy of the cache.

// a window's rows: int4's 160 full-precision rows in float16 (as KIVI keeps its residual: half the bytes a step
// reads), int8's one part block in the activations' float32 (exact until the block fills)
template <int BITS> using WindowRow = std::conditional_t<BITS == 4, c10::Half, float>;

// A thread's buffers for the quantized attention's tasks: found once a task (QuantStores hands them out with its
// rows), where a thread_local a buffer was looked up on every use (a call into the loader each time, with its
// guard): ~5-8% of the int4 attention over 4,096 tokens in the processor's caches.
template <int BITS>
struct QuantScratch {
  std::vector<const uint8_t*> k_code, v_code;  // a tile's key blocks and value rows of codes, and their scales
  std::vector<const uint16_t*> k_prm, v_prm;   // (QuantStores)
  std::vector<float> scores;  // attend_tile
  std::vector<const WindowRow<BITS>*> window_k, window_v;
  std::vector<int64_t> last;
  std::vector<float> scale, minimum, weights, bias;  // weigh_quantized
  std::vector<int64_t> active, counts;
  std::vector<float> dw, qs, raw;  // the integer paths' weight grids, query scratch, the float path's codes
  std::vector<const float*> raw_rows;
  std::vector<uint8_t> w8, unpacked;
  std::vector<int16_t> w16, wide, qi;
  std::vector<int8_t> qb;
#ifdef KVSCOPE_AVX2
  std::vector<__m256i> pairs, acc256;
#endif
#ifdef __AVX512F__
  std::vector<__m512i> quads;
  std::vector<__m512> acc512;
#endif
  static QuantScratch& of_this_thread() {
    thread_local QuantScratch scratch;
    return scratch;
  }
};

// Where the AVX-512 path reads a quantized store (kv_tiled), a block of a multiple of 16 tokens keeps its codes in
// tiles of 16 tokens laid out as that path reads them, so that no read transposes them: keys [W / 4][16][4] (dword
// g of the 16 tokens: one register), values [4][W][4] (a quad's four tokens side by side per byte of a row). Rows
// are W = D * bits / 8 bytes, and tiles take the rows' place: a tile starts where its first row would, and a quad
// where its first row would. Byte j of row r, counted from a tile's start:
constexpr int64_t TILE_TOKENS = 16;
inline int64_t tiled_key_at(int64_t r, int64_t j, int64_t w) {
  return r / TILE_TOKENS * TILE_TOKENS * w + r % TILE_TOKENS * 4 + j / 4 * 64 + j % 4;
}
inline int64_t tiled_value_at(int64_t r, int64_t j, int64_t w) { return r / 4 * 4 * w + r % 4 + 4 * j; }

// a block's bs rows of w bytes -> its tiles (keys' or values')
inline void to_tiles(const uint8_t* rows, int64_t bs, int64_t w, bool keys, uint8_t* tiles) {
  for (int64_t r = 0; r < bs; ++r)
    for (int64_t j = 0; j < w; ++j) tiles[keys ? tiled_key_at(r, j, w) : tiled_value_at(r, j, w)] = rows[r * w + j];
}

// the w bytes of the tiled row of position p that would start at `row` (keys' or values') -> out, as a row
template <bool KEYS>
inline void untile_row(const uint8_t* row, int64_t p, int64_t w, uint8_t* out) {
  int64_t r = p % TILE_TOKENS;
  const uint8_t* tile = row - r * w;
  for (int64_t j = 0; j < w; ++j) out[j] = tile[KEYS ? tiled_key_at(r, j, w) : tiled_value_at(r, j, w)];
}

// x / size (x >= 0), by a shift where size is a power of two (shift: its log2, else -1): a division per block was
// ~10% of a quantized tile's set-up (StepMap::blocks, QuantRows::block_of)
inline int64_t in_blocks(int64_t x, int shift, int64_t size) { return shift >= 0 ? x >> shift : x / size; }

template <int BITS>
struct QuantRows {
  int64_t first = 0, full = 0, ring = 1;  // ring: the window's rows (position p in row p % ring)
  int64_t sink = 0;                     // positions below it are read from the sink rows
  const WindowRow<BITS>* sink_rows = nullptr;  // [sink, D]
  // values, per quantized position from `first`: its codes, and its scale (int4: then its minimum)
  const uint8_t* const* code = nullptr;
  const uint16_t* const* param = nullptr;
  // keys, per block from first_block: where its first position's codes start (its rows follow, row_bytes apart),
  // and its [D] scales (int4: then [D] minimums). Per block, where a table per position was: a 320-position tile's
  // four tables were written to memory that had left the L1 since the thread's last task (an int4 task at 4,096
  // tokens: ~1,560 cycles of tables against ~8,900 computing, ~730 now; rdtsc around them, Xeon)
  const uint8_t* const* block_code = nullptr;
  const uint16_t* const* block_param = nullptr;
  int64_t first_block = 0, row_bytes = 0;
  int64_t known = 0;  // keys: the tables cover [first, known), the tile's codes and the next ones, to prefetch
  int64_t end = 0;    // the sequence's length: the window holds [full, end)
  int64_t block_size = 1;  // positions [k bs, (k + 1) bs) share a block's key scales and adjacent rows
  int block_shift = -1;    // log2(block_size) where it is a power of two, else -1 (in_blocks)
  bool tiled = false;      // codes in tiles (kv_tiled); code[p] is where row p would start all the same
  int64_t block_of(int64_t p) const { return in_blocks(p, block_shift, block_size); }
  int64_t block_end(int64_t p, int64_t limit) const { return std::min(limit, (block_of(p) + 1) * block_size); }
  const uint8_t* key_row(int64_t p) const {  // where position p's key codes start
    int64_t blk = block_of(p);
    return block_code[blk - first_block] + (p - blk * block_size) * row_bytes;
  }
  const uint16_t* key_param(int64_t p) const { return block_param[block_of(p) - first_block]; }
  const WindowRow<BITS>* window = nullptr;     // [ring, D] rows
  QuantScratch<BITS>* scratch = nullptr;  // the task's thread's buffers
};

template <int BITS>
inline float code_at(const uint8_t* row, int64_t j, int64_t d) {
  if constexpr (BITS == 8) return static_cast<float>(reinterpret_cast<const int8_t*>(row)[j]);
  int64_t half = d / 2;
  return static_cast<float>(j < half ? row[j] & 0x0F : row[j - half] >> 4);
}

#ifdef KVSCOPE_AVX2
// channels j..j+7 of a row of codes as floats
template <int BITS>
inline __m256 codes8(const uint8_t* row, int64_t j, int64_t half) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j))));
  } else {
    bool high = j >= half;
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (high ? j - half : j)));
    if (high) b = _mm_srli_epi16(b, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
  }
}

#endif

// n rows of codes as floats (the codes' values, no scale) into out [n, D]: converted once, read by every query
template <int BITS>
inline void codes_to_floats(const uint8_t* const* rows, int64_t n, int64_t d, float* out) {
  for (int64_t p = 0; p < n; ++p) {
#ifdef KVSCOPE_AVX2
    for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(out + p * d + j, codes8<BITS>(rows[p], j, d / 2));
#else
    for (int64_t j = 0; j < d; ++j) out[p * d + j] = code_at<BITS>(rows[p], j, d);
#endif
  }
}

// A block's key parameters. int8: [D] float16 scales. int4, two-level (engine/kv/quant.py): bytes [D] 8-bit
// scales (1..255), [D] 8-bit minimums (-127..127), then two float16 super scales; scale = s_super * code,
// min = m_super * code (exact in float32). `param` points at the block's first byte either way.
inline std::pair<float, float> int4_supers(const uint16_t* param, int64_t d) {
  const uint16_t* supers = param + d;  // byte 2D
  return {half_to_float(supers[0]), half_to_float(supers[1])};
}

inline float key_scale(const uint16_t* param, int64_t d, int64_t j, int bits) {
  if (bits == 8) return half_to_float(param[j]);
  return reinterpret_cast<const uint8_t*>(param)[j] * int4_supers(param, d).first;
}

inline float key_min(const uint16_t* param, int64_t d, int64_t j) {
  return reinterpret_cast<const int8_t*>(param)[d + j] * int4_supers(param, d).second;
}

#ifdef KVSCOPE_AVX2
// channels j..j+7 of a block's key scales and (int4) minimums
template <int BITS>
inline std::pair<__m256, __m256> key_params8(const uint16_t* param, int64_t d, int64_t j) {
  if constexpr (BITS == 8) return {halves8(param + j), _mm256_setzero_ps()};
  auto [s_super, m_super] = int4_supers(param, d);
  auto bytes = reinterpret_cast<const uint8_t*>(param);
  __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + j))));
  __m256 mc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + d + j))));
  return {_mm256_mul_ps(sc, _mm256_set1_ps(s_super)), _mm256_mul_ps(mc, _mm256_set1_ps(m_super))};
}
#endif

// a query against one block's keys: qs = q * scale per channel; bias = q . min (int4; 0 for int8)
template <int BITS>
inline float scale_query(const float* q, const uint16_t* param, int64_t d, float* qs) {
#ifdef KVSCOPE_AVX2
  __m256 bias = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    __m256 qj = _mm256_loadu_ps(q + j);
    auto [sc, mn] = key_params8<BITS>(param, d, j);
    _mm256_storeu_ps(qs + j, _mm256_mul_ps(qj, sc));
    if constexpr (BITS == 4) bias = _mm256_fmadd_ps(qj, mn, bias);
  }
  return hsum(bias);
#else
  float bias = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    qs[j] = q[j] * key_scale(param, d, j, BITS);
    if constexpr (BITS == 4) bias += q[j] * key_min(param, d, j);
  }
  return bias;
#endif
}

// The query's grid: int8 keys meet two int8 parts (|x| <= 127.5 * 256, 15 bits); int4 keys, whose codes carry 4
// bits, one part (|x| <= 127), which halves the score's products: on real text int4's mean KL against a float32
// cache went 0.00138 -> 0.00144 nats (top-1 98.6% -> 98.5%; tests/test_int8_quality.py)
template <int BITS> constexpr float QUERY_GRID = BITS == 4 ? 127.f : 32512.f;

#ifdef KVSCOPE_AVX2
// ---- int4 / int8 keys by integer dot products: a block's per-channel key scales fold into the query, qs = q * scale,
// which goes onto an int16 grid per block, qs ~ dq * qi (15 bits of its largest channel, as the weight kernels'
// two-part activations); its dot with a key's codes (int4 0..15, int8 -127..127 widened to int16 in registers) is exact
// in int32 (madd: at most D * 127 * 32767 for int8, D <= 256), so score = dq * (codes . qi) + q . min.
constexpr int64_t CODE_LANES = 32;  // channels per register of unpacked codes

inline int64_t padded_channels(int64_t d) { return (d + CODE_LANES - 1) / CODE_LANES * CODE_LANES; }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// n rows of int4 codes (D/2 bytes) -> their codes 0..15, one a byte in channel order, rows of dp bytes (0 after d)
inline void unpack_int4(const uint8_t* const* rows, int64_t n, int64_t d, int64_t dp, uint8_t* out) {
  int64_t half = d / 2;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t p = 0; p < n; ++p) {
    uint8_t* o = out + p * dp;
    if (half % CODE_LANES) {
      for (int64_t j = 0; j < half; ++j) o[j] = rows[p][j] & 0x0F, o[half + j] = rows[p][j] >> 4;
      std::fill(o + d, o + dp, uint8_t{0});
      continue;
    }
    for (int64_t j = 0; j < half; j += CODE_LANES) {
      __m256i b = load256(rows[p] + j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), _mm256_and_si256(b, low));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + half + j), _mm256_and_si256(_mm256_srli_epi16(b, 4), low));
    }
  }
}

// n rows of codes -> one byte a channel, rows of dp (zeros from d): int4 unpacked, int8 as stored (signed)
template <int BITS>
inline void unpack_codes(const uint8_t* const* rows, int64_t n, int64_t d, int64_t dp, uint8_t* out) {
  if constexpr (BITS == 4) return unpack_int4(rows, n, d, dp, out);
  for (int64_t p = 0; p < n; ++p) {  // a row of 64 or 128 bytes: copied in registers (memcpy: a call a row, 5% of a step)
    uint8_t* o = out + p * dp;
    if (d % CODE_LANES == 0)
      for (int64_t j = 0; j < d; j += CODE_LANES) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), load256(rows[p] + j));
    else
      std::memcpy(o, rows[p], d);
    std::fill(o + d, o + dp, uint8_t{0});
  }
}

// n rows of int8 codes (d bytes each, d a multiple of 16) -> int16, rows of dp (zeros from d)
inline void widen_int8_rows(const uint8_t* const* rows, int64_t n, int64_t d, int64_t dp, int16_t* out) {
  for (int64_t p = 0; p < n; ++p, out += dp) {
    for (int64_t j = 0; j < d; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[p] + j))));
    std::fill(out + d, out + dp, int16_t{0});
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// a query against one block of keys (its scales sc and minimums mn as floats): qs = q * scale per channel as
// int16, qs ~ dq * qi (zeros from d to dp); bias = q . min (int4; 0 for int8); returns dq
inline float query_int16(const float* q, const float* sc, const float* mn, int64_t d, int64_t dp, float* qs,
                         int16_t* qi, float* bias) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    __m256 qj = _mm256_loadu_ps(q + j), x = _mm256_mul_ps(qj, _mm256_load_ps(sc + j));
    _mm256_storeu_ps(qs + j, x);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x));
    b = _mm256_fmadd_ps(qj, _mm256_load_ps(mn + j), b);
  }
  *bias = hsum(b);
  float top = hmax(amax), inv = top > 0.f ? 32767.f / top : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < d; j += 16) {  // packs keeps lanes: 8 of x[j..] then 8 of x[j + 8..] per pair of lanes
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qs + j), vinv));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qs + j + 8), vinv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8));
  }
  std::fill(qi + d, qi + dp, int16_t{0});
  return top / 32767.f;
}

// scores of an int16 query against n rows of int16 codes (C registers of 16 each): out[p] = dq * (codes . qi)
// + bias, four rows at a time (a last group reads its last row again in the missing places)
template <int C>
void score_codes_fixed(const int16_t* codes, int64_t n, const int16_t* qi, float dq, float bias, float* out) {
  __m256i qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load256(qi + 16 * c);
  const __m128 vdq = _mm_set1_ps(dq), vbias = _mm_set1_ps(bias);
  for (int64_t p = 0; p < n; p += 4) {
    __m256i s[4];
    for (int r = 0; r < 4; ++r) {
      const int16_t* row = codes + std::min(p + r, n - 1) * C * 16;
      s[r] = _mm256_madd_epi16(load256(row), qv[0]);
      for (int c = 1; c < C; ++c) s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(load256(row + 16 * c), qv[c]));
    }
    __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    alignas(16) float f[4];
    _mm_store_ps(f, _mm_fmadd_ps(_mm_cvtepi32_ps(four), vdq, vbias));
    for (int64_t r = 0; r < 4 && p + r < n; ++r) out[p + r] = f[r];
  }
}

// two rows' sums for NV queries: s0[v] = row0 . qi[v], s1[v] = row1 . qi[v] (int32 lanes); each 16 channels of a
// query are loaded once for both rows (the loads, not the products, bounded a row at a time)
template <int C, int NV>
__attribute__((always_inline)) inline void int8_pair_sums(const uint8_t* row0, const uint8_t* row1,
                                                          const int16_t* const* qi, __m256i* s0, __m256i* s1) {
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    __m256i r0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row0 + 16 * c)));
    __m256i r1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + 16 * c)));
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      __m256i qv = load256(qi[v] + 16 * c), m0 = _mm256_madd_epi16(r0, qv), m1 = _mm256_madd_epi16(r1, qv);
      s0[v] = c ? _mm256_add_epi32(s0[v], m0) : m0;
      s1[v] = c ? _mm256_add_epi32(s1[v], m1) : m1;
      asm("" : "+x"(s0[v]), "+x"(s1[v]));  // (one chain a sum, as madd_add)
    }
  }
}

// NV vectors' scores against n rows, eight rows a register of sums: pair_sums(row0, row1, s0, s1) gives two rows'
// int32 lane sums for every vector (exact, in any order), and out_v[p] = fma(sum, dq_v, bias_v) as score_codes and
// score_nibbles compute them four rows at a time (the same bits; no scalar stores). Every loop is unrolled so that
// the arrays stay in registers (GCC kept a rolled loop's sums on the stack: the int8 scoring 1.3x as long)
template <int NV, typename PairSums>
__attribute__((always_inline)) inline void score_rows8(const uint8_t* const* rows, int64_t n, const float* dq,
                                                       const float* bias, float* const* out, PairSums pair_sums) {
  for (int64_t p = 0; p < n; p += 8) {
    __m256i four[2][NV];  // per vector: tokens p..p+3, then p+4..p+7, as the two 128-bit halves' partial sums
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i two[2][NV];
#pragma GCC unroll 2
      for (int t2 = 0; t2 < 2; ++t2) {
        __m256i s0[NV], s1[NV];
        int64_t t = p + 4 * h + 2 * t2;  // (a last group reads its last row again in the missing places)
        pair_sums(rows[std::min(t, n - 1)], rows[std::min(t + 1, n - 1)], s0, s1);
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) two[t2][v] = _mm256_hadd_epi32(s0[v], s1[v]);
      }
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) four[h][v] = _mm256_hadd_epi32(two[0][v], two[1][v]);
    }
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) {
      __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(four[0][v], four[1][v], 0x20),
                                      _mm256_permute2x128_si256(four[0][v], four[1][v], 0x31));
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dq[v]), _mm256_set1_ps(bias[v]));
      if (p + 8 <= n) {
        _mm256_storeu_ps(out[v] + p, f);
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, f);
        std::copy(tail, tail + (n - p), out[v] + p);
      }
    }
  }
}

// score_codes' sums for NV int16 queries straight from n rows of int8 codes (C * 16 bytes each): no widened copy
// of the block
template <int C, int NV>
void score_int8_rows(const uint8_t* const* rows, int64_t n, const int16_t* const* qi, const float* dq,
                     const float* bias, float* const* out) {
  score_rows8<NV>(rows, n, dq, bias, out, [&](const uint8_t* r0, const uint8_t* r1, __m256i* s0, __m256i* s1) {
    int8_pair_sums<C, NV>(r0, r1, qi, s0, s1);
  });
}

// whether score_int8_rows takes keys of d channels
inline bool int8_rows_fit(int64_t d) { return d == 32 || d == 64 || d == 96 || d == 128; }

template <int NV>
inline void score_int8_rows_any(const uint8_t* const* rows, int64_t n, int64_t d, const int16_t* const* qi,
                                const float* dq, const float* bias, float* const* out) {
  switch (d / 16) {
    case 2: return score_int8_rows<2, NV>(rows, n, qi, dq, bias, out);
    case 4: return score_int8_rows<4, NV>(rows, n, qi, dq, bias, out);
    case 6: return score_int8_rows<6, NV>(rows, n, qi, dq, bias, out);
    case 8: return score_int8_rows<8, NV>(rows, n, qi, dq, bias, out);
    default: TORCH_CHECK(false, "score_int8_rows: head_dim ", d);
  }
}

inline void score_codes(const int16_t* codes, int64_t n, int64_t dp, const int16_t* qi, float dq, float bias,
                        float* out) {
  switch (dp / 16) {  // dp is a multiple of 32
    case 2: return score_codes_fixed<2>(codes, n, qi, dq, bias, out);
    case 4: return score_codes_fixed<4>(codes, n, qi, dq, bias, out);
    case 6: return score_codes_fixed<6>(codes, n, qi, dq, bias, out);
    case 8: return score_codes_fixed<8>(codes, n, qi, dq, bias, out);
    case 10: return score_codes_fixed<10>(codes, n, qi, dq, bias, out);
    case 12: return score_codes_fixed<12>(codes, n, qi, dq, bias, out);
    case 14: return score_codes_fixed<14>(codes, n, qi, dq, bias, out);
    case 16: return score_codes_fixed<16>(codes, n, qi, dq, bias, out);
    default: TORCH_CHECK(false, "quantized keys: head_dim up to 256");
  }
}

// int4 keys on AVX2: a query against one block as one int8 part (QUERY_GRID<4>), qs ~ dq * qi (zeros from d to
// dp); bias = q . min; returns dq. Its dot with a row of codes 0..15 is maddubs' (no pair reaches int16's limit:
// dp / 32 registers of 2 * 15 * 127 each, at most 30,480 for D = 256).
inline float query_int8(const float* q, const float* sc, const float* mn, int64_t d, int64_t dp, float* qs,
                        int8_t* qi, float* bias) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    __m256 qj = _mm256_loadu_ps(q + j), x = _mm256_mul_ps(qj, _mm256_load_ps(sc + j));
    _mm256_storeu_ps(qs + j, x);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x));
    b = _mm256_fmadd_ps(qj, _mm256_load_ps(mn + j), b);
  }
  *bias = hsum(b);
  float top = hmax(amax), inv = top > 0.f ? QUERY_GRID<4> / top : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order, undone
  auto grid = [&](int64_t j) { return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qs + j), vinv)); };
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) {
    __m256i ab = _mm256_packs_epi32(grid(j), grid(j + 8)), cd = _mm256_packs_epi32(grid(j + 16), grid(j + 24));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + j), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order));
  }
  for (; j < d; ++j) qi[j] = static_cast<int8_t>(std::nearbyint(qs[j] * inv));
  std::fill(qi + d, qi + dp, int8_t{0});
  return top / QUERY_GRID<4>;
}

// scores of an int8 query against n rows of unpacked int4 codes (C registers of 32 each): out[p] = dq * (codes . qi)
// + bias, four rows at a time (a last group reads its last row again in the missing places)
template <int C>
void score_nibbles_fixed(const uint8_t* codes, int64_t n, const int8_t* qi, float dq, float bias, float* out) {
  __m256i qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load256(qi + 32 * c);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128 vdq = _mm_set1_ps(dq), vbias = _mm_set1_ps(bias);
  for (int64_t p = 0; p < n; p += 4) {
    __m256i s[4];
    for (int r = 0; r < 4; ++r) {
      const uint8_t* row = codes + std::min(p + r, n - 1) * C * 32;
      __m256i pairs = _mm256_maddubs_epi16(load256(row), qv[0]);
      for (int c = 1; c < C; ++c) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(load256(row + 32 * c), qv[c]));
      s[r] = _mm256_madd_epi16(pairs, ones);
    }
    __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    alignas(16) float f[4];
    _mm_store_ps(f, _mm_fmadd_ps(_mm_cvtepi32_ps(four), vdq, vbias));
    for (int64_t r = 0; r < 4 && p + r < n; ++r) out[p + r] = f[r];
  }
}

// score_nibbles' sums for NV int8 queries (channel order, as unpack_int4) straight from n rows of packed int4 codes
// (H32 * 32 bytes each, d = 64 * H32): a byte's low nibble is channel j, its high one half + j; two rows unpacked in
// registers for every vector, the int16 pairs of a row summed before one madd as score_nibbles does (the same sums)
// whether score_int4_rows takes keys of d channels
inline bool int4_rows_fit(int64_t d) { return d == 64 || d == 128; }

template <int H32, int NV>
void score_int4_rows(const uint8_t* const* rows, int64_t n, const int8_t* const* qb, const float* dq,
                     const float* bias, float* const* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  score_rows8<NV>(rows, n, dq, bias, out, [&](const uint8_t* r0, const uint8_t* r1, __m256i* s0, __m256i* s1) {
    __m256i p0[NV], p1[NV];
#pragma GCC unroll 8
    for (int c = 0; c < H32; ++c) {
      __m256i b0 = load256(r0 + 32 * c), b1 = load256(r1 + 32 * c);
      __m256i lo0 = _mm256_and_si256(b0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);
      __m256i lo1 = _mm256_and_si256(b1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) {
        __m256i ql = load256(qb[v] + 32 * c), qh = load256(qb[v] + 32 * (H32 + c));
        __m256i a0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ql), _mm256_maddubs_epi16(hi0, qh));
        __m256i a1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ql), _mm256_maddubs_epi16(hi1, qh));
        p0[v] = c ? _mm256_add_epi16(p0[v], a0) : a0;
        p1[v] = c ? _mm256_add_epi16(p1[v], a1) : a1;
      }
    }
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) s0[v] = _mm256_madd_epi16(p0[v], ones), s1[v] = _mm256_madd_epi16(p1[v], ones);
  });
}

inline void score_nibbles(const uint8_t* codes, int64_t n, int64_t dp, const int8_t* qi, float dq, float bias,
                          float* out) {
  switch (dp / 32) {  // dp is a multiple of 32
    case 1: return score_nibbles_fixed<1>(codes, n, qi, dq, bias, out);
    case 2: return score_nibbles_fixed<2>(codes, n, qi, dq, bias, out);
    case 3: return score_nibbles_fixed<3>(codes, n, qi, dq, bias, out);
    case 4: return score_nibbles_fixed<4>(codes, n, qi, dq, bias, out);
    case 5: return score_nibbles_fixed<5>(codes, n, qi, dq, bias, out);
    case 6: return score_nibbles_fixed<6>(codes, n, qi, dq, bias, out);
    case 7: return score_nibbles_fixed<7>(codes, n, qi, dq, bias, out);
    case 8: return score_nibbles_fixed<8>(codes, n, qi, dq, bias, out);
    default: TORCH_CHECK(false, "quantized keys: head_dim up to 256");
  }
}

#endif

#if defined(KVSCOPE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KVSCOPE_KV512 1
// ---- AVX-512 (VNNI, VBMI): the same sums, 16 tokens or channels a register, fewer instructions a token.
// Keys: 16 rows of codes are transposed in registers so that a 32-bit lane holds four channels of one token; the
// query, q * scale per channel on a 15-bit grid per block, is split in two int8 parts (x = 256 hi + lo), and
// vpdpbusd sums codes (unsigned: int4 as they are, int8 plus 128) times each part: 16 tokens' exact int32 sums in
// one register, no horizontal sums. Values: four tokens' codes per channel as bytes meet their 8-bit weights in
// vpdpbusd (the AVX2 path's madd on int16 pairs gives the same exact int32 sums). Every integer sum is exact, so
// its order is free.
constexpr int64_t TOKENS_512 = 16;  // tokens a register of scores holds

inline bool kv512_keys(int bits, int64_t d) { return d <= 256 && d % (bits == 4 ? 32 : 16) == 0; }
inline bool kv512_values(int bits, int64_t d) { return d <= 256 && d % (bits == 4 ? 64 : 32) == 0; }

// the 16 tokens of a tile at `tile` (W = d * BITS / 8 bytes each) -> transpose_codes' quads, as loaded
template <int BITS, int D16>
inline void tile_quads(const uint8_t* tile, int64_t d_, __m512i* quads) {
  const int64_t dwords = (D16 ? D16 * 16 : d_) * BITS / 32;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < dwords; ++g) {
    __m512i x = _mm512_loadu_si512(tile + 64 * g);
    if constexpr (BITS == 4) {
      quads[g] = _mm512_and_si512(x, low);
      quads[dwords + g] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    } else {
      quads[g] = _mm512_xor_si512(x, flip);
    }
  }
}

struct QueryParts {  // a vector against one block: x = q * scale ~ dq * (256 hi + lo) (int8 keys) or dq * hi (int4)
  alignas(64) int8_t hi[256], lo[256];
  float dq, bias;  // bias: q . min (int4), 0 (int8)
  int32_t offset;  // int8: 128 * sum of (256 hi + lo), what the codes' +128 adds to the sums
};

// bytes packed from 64 channels (packs keep 128-bit lanes: lane L holds channels 4L..4L+3 of each of the four
// 16-channel sources, a dword each) -> channel order: dword g takes channels 4(g % 4).. of source g / 4
inline __m512i in_channel_order(__m512i packed) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
}

// 4 registers of int32 (channels 0-15, 16-31, 32-47, 48-63) -> their 64 values as saturated int8 in channel order
inline __m512i pack_bytes(__m512i a, __m512i b, __m512i c, __m512i d) {
  return in_channel_order(_mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d)));
}

// up to four vectors q[v] against one block (its parameters `param`): their QueryParts. The block's scales (and
// int4 minimums) are read into registers once for all of them, and x = q * scale stays in registers between its
// maximum and its codes. int4's super scales factor out: x is formed with the 8-bit scale codes (the grid 127 /
// max |x| is the same) and s_super goes into dq, m_super into the bias. int8's two parts are split in 16-bit lanes
// and the codes are packed 64 at a time (bytes past D are zeros). D16: d / 16 where known when compiled, else 0.
template <int BITS, int D16>
inline void query_parts(const float* const* q, int nv, const uint16_t* param, int64_t d_, QueryParts* const* out) {
  const int64_t d = D16 ? D16 * 16 : d_, regs = d / 16;
  constexpr int64_t MAX_REGS = D16 ? D16 : 16;  // d <= 256
  __m512 sc[MAX_REGS], mn[MAX_REGS];
  auto bytes = reinterpret_cast<const uint8_t*>(param);
  auto [s_super, m_super] = BITS == 4 ? int4_supers(param, d) : std::pair<float, float>{1.f, 0.f};
  for (int64_t j = 0; j < regs; ++j) {
    if constexpr (BITS == 8) {
      sc[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(param + 16 * j)));
    } else {
      __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * j));
      __m128i m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + d + 16 * j));
      sc[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s8));
      mn[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m8));
    }
  }
  __m512 amax[4], b[4], x[4][MAX_REGS];
  for (int v = 0; v < 4; ++v) amax[v] = b[v] = _mm512_setzero_ps();
  for (int v = 0; v < nv; ++v)
    for (int64_t j = 0; j < regs; ++j) {
      __m512 qj = _mm512_loadu_ps(q[v] + 16 * j);
      x[v][j] = _mm512_mul_ps(qj, sc[j]);
      amax[v] = _mm512_max_ps(amax[v], _mm512_abs_ps(x[v][j]));
      if constexpr (BITS == 4) b[v] = _mm512_fmadd_ps(qj, mn[j], b[v]);
    }
  alignas(16) float top[4], bias[4];
  _mm_store_ps(top, reduce4<true>(amax[0], amax[1], amax[2], amax[3]));
  if constexpr (BITS == 4) _mm_store_ps(bias, reduce4<false>(b[0], b[1], b[2], b[3]));
  const float grid = QUERY_GRID<BITS>;
  for (int v = 0; v < nv; ++v) {
    const __m512 vinv = _mm512_set1_ps(top[v] > 0.f ? grid / top[v] : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int64_t j0 = 0; j0 < regs; j0 += 4) {
      __m512i xi[4];
      for (int64_t u = 0; u < 4; ++u)
        xi[u] = j0 + u < regs ? _mm512_cvtps_epi32(_mm512_mul_ps(x[v][j0 + u], vinv)) : _mm512_setzero_si512();
      if constexpr (BITS == 4) {  // one part: |x| <= 127
        _mm512_store_si512(out[v]->hi + 16 * j0, pack_bytes(xi[0], xi[1], xi[2], xi[3]));
        continue;
      }
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_add_epi32(xi[0], xi[1]), _mm512_add_epi32(xi[2], xi[3])));
      // |x| <= 32512: hi = (x + 128) >> 8 in -127..127 and lo = x - 256 hi in -128..127, in 16-bit lanes
      __m512i w[2] = {_mm512_packs_epi32(xi[0], xi[1]), _mm512_packs_epi32(xi[2], xi[3])}, hi[2], lo[2];
      for (int u = 0; u < 2; ++u) {
        hi[u] = _mm512_srai_epi16(_mm512_add_epi16(w[u], _mm512_set1_epi16(128)), 8);
        lo[u] = _mm512_sub_epi16(w[u], _mm512_slli_epi16(hi[u], 8));
      }
      _mm512_store_si512(out[v]->hi + 16 * j0, in_channel_order(_mm512_packs_epi16(hi[0], hi[1])));
      _mm512_store_si512(out[v]->lo + 16 * j0, in_channel_order(_mm512_packs_epi16(lo[0], lo[1])));
    }
    out[v]->dq = top[v] * s_super / grid;
    out[v]->bias = BITS == 4 ? bias[v] * m_super : 0.f;
    out[v]->offset = BITS == 8 ? 128 * _mm512_reduce_add_epi32(total) : 0;
  }
}

// rows[0..16) (row bytes `bytes`, a multiple of 16) -> quads[g]: channels 4g..4g+3 of the 16 tokens, one token a
// 32-bit lane, as unsigned bytes (int4: the codes; int8: code + 128); D / 4 registers
template <int BITS, int D16>
inline void transpose_codes(const uint8_t* const* rows, int64_t bytes_, __m512i* quads) {
  const int64_t bytes = D16 ? D16 * 2 * BITS : bytes_;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t dwords = bytes / 4;
  for (int64_t c = 0; c < bytes; c += 16) {
    __m512i z[4];  // z[i], 128-bit lane L: bytes c..c+15 of row 4L + i
    for (int i = 0; i < 4; ++i) {
      auto at = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + c)); };
      z[i] = _mm512_castsi128_si512(at(i));
      z[i] = _mm512_inserti32x4(z[i], at(4 + i), 1);
      z[i] = _mm512_inserti32x4(z[i], at(8 + i), 2);
      z[i] = _mm512_inserti32x4(z[i], at(12 + i), 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    __m512i o[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                    _mm512_unpackhi_epi64(t1, t3)};  // o[k]: dword c / 4 + k of the 16 rows
    for (int k = 0; k < 4; ++k) {
      int64_t g = c / 4 + k;
      if constexpr (BITS == 4) {
        quads[g] = _mm512_and_si512(o[k], low);  // channels 4g.. (low nibbles), half + 4g.. (high)
        quads[dwords + g] = _mm512_and_si512(_mm512_srli_epi16(o[k], 4), low);
      } else {
        quads[g] = _mm512_xor_si512(o[k], flip);
      }
    }
  }
}

// transpose_codes of the n (<= 16) tiled rows at code[0..n) from position p, which do not start a tile, read as rows
// (a last chunk of fewer reads its last row again; those scores are dropped)
template <int BITS, int D16>
__attribute__((noinline)) void untiled_quads(const uint8_t* const* code, int64_t n, int64_t p, int64_t d,
                                             __m512i* quads) {
  const uint8_t* rows[TOKENS_512];
  alignas(64) uint8_t plain[TOKENS_512 * 256];  // (W <= 256 where tiles are kept)
  const int64_t w = d * BITS / 8;
  for (int64_t r = 0; r < TOKENS_512; ++r)
    untile_row<true>(code[std::min(r, n - 1)], p + std::min(r, n - 1), w, plain + r * w), rows[r] = plain + r * w;
  transpose_codes<BITS, D16>(rows, w, quads);
}

// 16 tokens' scores for one vector: dq * (codes . (256 hi + lo) - offset) + bias (int4: codes . hi), from
// transpose_codes' quads
template <int BITS, int D16>
inline __m512 score_quads(const __m512i* quads, int64_t d_, const QueryParts& qp) {
  const int64_t d = D16 ? D16 * 16 : d_;
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;  // two chains a part
  auto hi = reinterpret_cast<const int32_t*>(qp.hi);
  auto lo = reinterpret_cast<const int32_t*>(qp.lo);
  if constexpr (BITS == 4) {  // one part
    for (int64_t g = 0; g < d / 4; g += 2) {
      h0 = _mm512_dpbusd_epi32(h0, quads[g], _mm512_set1_epi32(hi[g]));
      h1 = _mm512_dpbusd_epi32(h1, quads[g + 1], _mm512_set1_epi32(hi[g + 1]));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), _mm512_set1_ps(qp.dq), _mm512_set1_ps(qp.bias));
  }
  for (int64_t g = 0; g < d / 4; g += 2) {
    h0 = _mm512_dpbusd_epi32(h0, quads[g], _mm512_set1_epi32(hi[g]));
    l0 = _mm512_dpbusd_epi32(l0, quads[g], _mm512_set1_epi32(lo[g]));
    h1 = _mm512_dpbusd_epi32(h1, quads[g + 1], _mm512_set1_epi32(hi[g + 1]));
    l1 = _mm512_dpbusd_epi32(l1, quads[g + 1], _mm512_set1_epi32(lo[g + 1]));
  }
  __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
  sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(qp.offset));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(qp.dq), _mm512_set1_ps(qp.bias));
}

// n QueryParts for a block seen by more vectors than a decode row has (a prefill's rows): the thread's own, kept
// between calls (out of line: a thread_local declared in the block loop is looked up each time it is passed)
__attribute__((noinline)) QueryParts* many_query_parts(int64_t n) {
  thread_local std::vector<QueryParts> many;
  many.resize(n);
  return many.data();
}

// score_int_block's sums, 16 tokens at a time: the scores of every vector against one block [s, e); D16: d / 16
// where known when compiled (the loops unrolled, a block's parameters and query in registers), else 0
template <int BITS, int D16>
void score_block_512(const float* q, const uint8_t* const* code, const uint16_t* prm, const int64_t* last,
                     int64_t nq, int64_t d, int64_t s, int64_t e, int64_t k0, float* scores, int64_t padded,
                     Prefetches* ahead, bool tiled) {
  int64_t chunks = (e - s + TOKENS_512 - 1) / TOKENS_512;
  const int64_t steps = chunks * (nq + 1) + 1;  // a step's share of the queued lines (none: no division)
  int each = ahead->left() ? static_cast<int>((ahead->left() + steps - 1) / steps) : 0;
  __m512i quads[64];
  QueryParts few[8];  // a decode row's vectors on the stack: a thread_local costs a call into the loader
  QueryParts* parts = nq <= 8 ? few : many_query_parts(nq);
  const float* qv[4];
  QueryParts* out[4];
  int nv = 0;
  for (int64_t i = 0; i < nq; ++i) {  // the vectors that see the block, four at a time
    if (s - k0 <= last[i]) qv[nv] = q + i * d, out[nv++] = &parts[i];
    if (nv == 4 || (i == nq - 1 && nv)) query_parts<BITS, D16>(qv, nv, prm, d, out), nv = 0;
  }
  ahead->issue(each);
  for (int64_t c = s; c < e; c += TOKENS_512) {
    int64_t n = std::min(TOKENS_512, e - c);
    if (!tiled) {
      const uint8_t* rows[TOKENS_512];  // a last chunk of fewer reads its last row again; those scores are dropped
      for (int64_t r = 0; r < TOKENS_512; ++r) rows[r] = code[std::min(c + r, e - 1) - s];
      transpose_codes<BITS, D16>(rows, d * BITS / 8, quads);
    } else if (c % TILE_TOKENS == 0) {  // a tile (a last chunk of fewer: the other lanes' scores are dropped)
      tile_quads<BITS, D16>(code[c - s], d, quads);
    } else {
      untiled_quads<BITS, D16>(code + (c - s), n, c, d, quads);
    }
    ahead->issue(each);
    for (int64_t i = 0; i < nq; ++i) {
      if (c - k0 <= last[i])
        _mm512_mask_storeu_ps(scores + i * padded + c - k0, static_cast<__mmask16>((1u << n) - 1),
                              score_quads<BITS, D16>(quads, d, parts[i]));
      ahead->issue(each);
    }
  }
}

template <int BITS>
void score_block_512_any(const float* q, const uint8_t* const* code, const uint16_t* prm, const int64_t* last,
                         int64_t nq, int64_t d, int64_t s, int64_t e, int64_t k0, float* scores, int64_t padded,
                         Prefetches* ahead, bool tiled) {
  if (d == 64) return score_block_512<BITS, 4>(q, code, prm, last, nq, d, s, e, k0, scores, padded, ahead, tiled);
  if (d == 128) return score_block_512<BITS, 8>(q, code, prm, last, nq, d, s, e, k0, scores, padded, ahead, tiled);
  score_block_512<BITS, 0>(q, code, prm, last, nq, d, s, e, k0, scores, padded, ahead, tiled);
}

#endif

// whether a block's prefetches are spread over its scoring, its value codes sent to L2 (int8 on the AVX-512 path;
// else all at once, the values' into L1)
inline bool spread_prefetches(int bits, int64_t d) {
#ifdef KVSCOPE_KV512
  return bits == 8 && kv512_values(bits, d);
#else
  return false;
#endif
}

#ifdef KVSCOPE_AVX2
// ---- quantized values by integer products: each vector's weights w_p = e_p * scale_p (its softmax weight times
// the token's value scale) go onto an 8-bit grid per chunk of WEIGHT_CHUNK tokens, w ~ dw_c * w8 (dw_c = the
// chunk's largest w / 255); a chunk's sums of codes times w8 are exact in int32 (at most 32 * 255 * 127), and the
// chunks are added in position order, out = fma(sums_c, dw_c, out): the same integers and the same float steps on
// every instruction set (AVX-512 VNNI: four tokens a 32-bit lane by vpdpbusd; AVX2: two by madd on int16 pairs).
constexpr int64_t WEIGHT_CHUNK = 32;   // tokens interleaved at a time (read by every vector from L1), one weight grid
constexpr int64_t PAIRS_AT_ONCE = WEIGHT_CHUNK / 2;

// unpacked codes (dp bytes a row) of tokens a and b -> per 32 channels four registers of int16 pairs (a_j, b_j):
// channels {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27}, {12-15, 28-31} of the group (the unpack's lane order);
// int8's codes are signed: each byte is widened with its sign byte instead of a zero
template <int BITS>
inline void interleave_pair(const uint8_t* a, const uint8_t* b, int64_t dp, __m256i* out) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t j = 0; j < dp; j += CODE_LANES, out += 4) {
    __m256i ra = load256(a + j), rb = load256(b + j);
    __m256i t0 = _mm256_unpacklo_epi8(ra, rb), t1 = _mm256_unpackhi_epi8(ra, rb);
    __m256i s0 = BITS == 8 ? _mm256_cmpgt_epi8(zero, t0) : zero, s1 = BITS == 8 ? _mm256_cmpgt_epi8(zero, t1) : zero;
    out[0] = _mm256_unpacklo_epi8(t0, s0);
    out[1] = _mm256_unpackhi_epi8(t0, s0);
    out[2] = _mm256_unpacklo_epi8(t1, s1);
    out[3] = _mm256_unpackhi_epi8(t1, s1);
  }
}

// interleave_pair's registers straight from two rows of packed int4 codes (half = d / 2 a multiple of 32): the low
// nibbles of a 32-byte chunk are channels [c, c + 32), the high ones [half + c, ..), as unpack_int4 puts them
inline void interleave_packed_pair(const uint8_t* a, const uint8_t* b, int64_t d, __m256i* out) {
  const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0F);
  int64_t half = d / 2;
  __m256i* high = out + half / CODE_LANES * 4;
  for (int64_t c = 0; c < half; c += CODE_LANES, out += 4, high += 4) {
    __m256i ra = load256(a + c), rb = load256(b + c);
    __m256i nibbles[2][2] = {{_mm256_and_si256(ra, low), _mm256_and_si256(rb, low)},
                             {_mm256_and_si256(_mm256_srli_epi16(ra, 4), low), _mm256_and_si256(_mm256_srli_epi16(rb, 4), low)}};
    for (int h = 0; h < 2; ++h) {
      __m256i* o = h ? high : out;
      __m256i t0 = _mm256_unpacklo_epi8(nibbles[h][0], nibbles[h][1]), t1 = _mm256_unpackhi_epi8(nibbles[h][0], nibbles[h][1]);
      o[0] = _mm256_unpacklo_epi8(t0, zero);
      o[1] = _mm256_unpackhi_epi8(t0, zero);
      o[2] = _mm256_unpacklo_epi8(t1, zero);
      o[3] = _mm256_unpackhi_epi8(t1, zero);
    }
  }
}

// acc (R registers of int32 in interleave_pair's order) += the n pairs' codes times their weights (w16[2r], w16[2r+1])
template <int R>
inline void madd_pairs(const __m256i* pairs, const int16_t* w16, int64_t n, __m256i* acc) {
  __m256i a[R];
  for (int k = 0; k < R; ++k) a[k] = acc[k];
  for (int64_t r = 0; r < n; ++r) {
    int32_t two;
    std::memcpy(&two, w16 + 2 * r, sizeof two);
    __m256i w = _mm256_set1_epi32(two);
    for (int k = 0; k < R; ++k) a[k] = _mm256_add_epi32(a[k], _mm256_madd_epi16(pairs[r * R + k], w));
  }
  for (int k = 0; k < R; ++k) acc[k] = a[k];
}

inline void madd_pairs_any(const __m256i* pairs, const int16_t* w16, int64_t n, int64_t regs, __m256i* acc) {
  switch (regs) {  // dp / 8, dp a multiple of 32 up to 256 (a head of 96 is 12 registers)
    case 4: return madd_pairs<4>(pairs, w16, n, acc);
    case 8: return madd_pairs<8>(pairs, w16, n, acc);
    case 12: return madd_pairs<12>(pairs, w16, n, acc);
    case 16: return madd_pairs<16>(pairs, w16, n, acc);
    case 20: return madd_pairs<20>(pairs, w16, n, acc);
    case 24: return madd_pairs<24>(pairs, w16, n, acc);
    case 28: return madd_pairs<28>(pairs, w16, n, acc);
    case 32: return madd_pairs<32>(pairs, w16, n, acc);
    default: TORCH_CHECK(false, "quantized values: head_dim up to 256");
  }
}

// int32 sums in interleave_pair's order -> out[0..d) = fma(sums, dw, out)
inline void fma_sums(const __m256i* acc, int64_t d, float dw, float* out) {
  const __m256 vdw = _mm256_set1_ps(dw);
  for (int64_t j = 0; j < d; j += CODE_LANES, acc += 4) {
    __m256i ch[4] = {_mm256_permute2x128_si256(acc[0], acc[1], 0x20), _mm256_permute2x128_si256(acc[2], acc[3], 0x20),
                     _mm256_permute2x128_si256(acc[0], acc[1], 0x31), _mm256_permute2x128_si256(acc[2], acc[3], 0x31)};
    for (int64_t c = 0; c < 4 && j + 8 * c < d; ++c)
      _mm256_storeu_ps(out + j + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ch[c]), vdw, _mm256_loadu_ps(out + j + 8 * c)));
  }
}

inline void add_bias(float* out, int64_t d, float bias) {
  for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(out + j), _mm256_set1_ps(bias)));
}

#ifdef KVSCOPE_AVX512
// the lanes of a chunk of WEIGHT_CHUNK tokens that hold its first k (first: 0-15, second: 16-31)
inline std::pair<__mmask16, __mmask16> chunk_lanes(int64_t k) {
  return {static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1),
          static_cast<__mmask16>(k >= 32 ? 0xFFFF : k <= 16 ? 0 : (1u << (k - 16)) - 1)};
}

// a chunk's weights x0, x1 (>= 0) -> integers 0..255 on its grid (q0, q1); returns the grid's step wmax / 255
inline float on_8bit_grid(__m512 x0, __m512 x1, __m512i& q0, __m512i& q1) {
  __m512 top16 = _mm512_max_ps(x0, x1);
  float wmax = hmax(_mm256_max_ps(_mm512_castps512_ps256(top16), _mm512_extractf32x8_ps(top16, 1)));
  const __m512 vinv = _mm512_set1_ps(wmax > 0.f ? 255.f / wmax : 0.f);
  q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
  return wmax / 255.f;
}
#endif

// a vector's weights w[0..n) (>= 0) -> integers 0..255 (as int16), one grid per WEIGHT_CHUNK tokens: w ~ dw[c] * w8,
// zeros from n to the last chunk's end (rounded to nearest, ties to even, as the vector conversion does)
inline void weights_8bit(const float* w, int64_t n, int16_t* w8, float* dw) {
  for (int64_t c0 = 0; c0 < n; c0 += WEIGHT_CHUNK) {
    int64_t m = std::min(WEIGHT_CHUNK, n - c0);
#ifdef KVSCOPE_AVX512  // the chunk in two registers (zeros past m), its integers narrowed in them: no copies
    auto [first, second] = chunk_lanes(m);
    __m512i q0, q1;
    dw[c0 / WEIGHT_CHUNK] = on_8bit_grid(_mm512_maskz_loadu_ps(first, w + c0), _mm512_maskz_loadu_ps(second, w + c0 + 16),
                                         q0, q1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w8 + c0), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w8 + c0 + 16), _mm512_cvtepi32_epi16(q1));
#else
    alignas(32) float tail[WEIGHT_CHUNK] = {};  // a last chunk's m weights, then zeros
    const float* x = w + c0;
    if (m < WEIGHT_CHUNK) std::copy(x, x + m, tail), x = tail;
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
    float wmax = hmax(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    const __m256 inv = _mm256_set1_ps(wmax > 0.f ? 255.f / wmax : 0.f);
    for (int k = 0; k < 4; k += 2) {  // 0..255 as int16, in order (packs keeps lanes: the permute puts them back)
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[k + 1], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w8 + c0 + 8 * k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    dw[c0 / WEIGHT_CHUNK] = wmax / 255.f;
#endif
  }
}

#endif

#ifdef KVSCOPE_KV512
// the codes of four tokens r[0..4) (row bytes d * BITS / 8) -> d / 16 registers of bytes, a 32-bit lane holding
// one channel of the four tokens, 16 channels a register: per 32 bytes of a row, int4 channels [c, c + 16),
// [half + c, ..), [c + 16, c + 32), [half + c + 16, ..); int8 channels [c, c + 16), [c + 16, c + 32). int4 codes
// 0..15 and int8 codes -127..127 are both vpdpbusd's signed operand as they are.
template <int BITS>
inline void quad_codes(const uint8_t* const* r, int64_t d, __m512i* out) {
  static const __m512i place = [] {  // byte 4i + k: token k's byte i (token k's 32 bytes sit at 32k of the pair)
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 4; ++k) idx[4 * i + k] = static_cast<uint8_t>(32 * k + i);
    return _mm512_load_si512(idx);
  }();
  const __m512i sixteen = _mm512_set1_epi8(16), low = _mm512_set1_epi8(0x0F);
  auto two = [](const uint8_t* x, const uint8_t* y) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(x)), load256(y), 1);
  };
  for (int64_t c = 0; c < d * BITS / 8; c += 32) {
    __m512i first = two(r[0] + c, r[1] + c), second = two(r[2] + c, r[3] + c);
    for (int m = 0; m < 2; ++m) {
      __m512i q = _mm512_permutex2var_epi8(first, m ? _mm512_add_epi8(place, sixteen) : place, second);
      if constexpr (BITS == 4) {
        *out++ = _mm512_and_si512(q, low);
        *out++ = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
      } else {
        *out++ = q;
      }
    }
  }
}

// the first channel of register r of quad_codes' output
inline int64_t quad_channel(int bits, int64_t r, int64_t d) {
  if (bits == 4) return r / 4 * 32 + (r % 4) / 2 * 16 + (r % 2) * (d / 2);
  return r * 16;
}

// out (R registers in quad_codes' order) = fma(sums, dw, out): sums of the n quads' codes times their weights
// (w8[4r..4r + 4))
template <int R>
inline void dpbusd_quads(const __m512i* quads, const uint8_t* w8, int64_t n, float dw, __m512* out) {
  __m512i a[R];
  for (int k = 0; k < R; ++k) a[k] = _mm512_setzero_si512();
  for (int64_t r = 0; r < n; ++r) {
    int32_t four;
    std::memcpy(&four, w8 + 4 * r, sizeof four);
    __m512i w = _mm512_set1_epi32(four);
    for (int k = 0; k < R; ++k) a[k] = _mm512_dpbusd_epi32(a[k], w, quads[r * R + k]);
  }
  const __m512 vdw = _mm512_set1_ps(dw);
  for (int k = 0; k < R; ++k) out[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[k]), vdw, out[k]);
}

inline void dpbusd_quads_any(const __m512i* quads, const uint8_t* w8, int64_t n, int64_t regs, float dw, __m512* out) {
  switch (regs) {  // d / 16: int4 4, 8, 12, 16; int8 any even number up to 16
    case 2: return dpbusd_quads<2>(quads, w8, n, dw, out);
    case 4: return dpbusd_quads<4>(quads, w8, n, dw, out);
    case 6: return dpbusd_quads<6>(quads, w8, n, dw, out);
    case 8: return dpbusd_quads<8>(quads, w8, n, dw, out);
    case 10: return dpbusd_quads<10>(quads, w8, n, dw, out);
    case 12: return dpbusd_quads<12>(quads, w8, n, dw, out);
    case 14: return dpbusd_quads<14>(quads, w8, n, dw, out);
    default: return dpbusd_quads<16>(quads, w8, n, dw, out);
  }
}

// a tiled quad of four tokens -> quad_codes' registers, as loaded
template <int BITS>
inline void quad_of_tile(const uint8_t* quad, int64_t d, __m512i* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t k = 0; k < d * BITS / 128; ++k) {
    __m512i x = _mm512_loadu_si512(quad + 64 * k);
    if constexpr (BITS == 4) {
      *out++ = _mm512_and_si512(x, low);
      *out++ = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
    } else {
      *out++ = x;
    }
  }
}

alignas(64) constexpr uint8_t ZERO_CODES[256] = {};  // the partners of a last chunk's last tokens (weight 0)

// quad_codes of the n (<= 4) tiled rows at rows[0..n) from position p, which do not start a quad, read as rows
// (zeros after them)
template <int BITS>
__attribute__((noinline)) void untiled_quad(const uint8_t* const* rows, int64_t n, int64_t p, int64_t d,
                                            __m512i* out) {
  alignas(64) uint8_t plain[4 * 256];  // (W <= 256 where tiles are kept)
  const uint8_t* four[4];
  const int64_t w = d * BITS / 8;
  for (int k = 0; k < 4; ++k) {
    four[k] = ZERO_CODES;
    if (k < n) untile_row<false>(rows[k], p + k, w, plain + k * w), four[k] = plain + k * w;
  }
  quad_codes<BITS>(four, d, out);
}

// one vector's softmax weights e[0..m) times the tokens' value scales, w = e * scale, onto weights_8bit's grids for
// the chunks of [0, n) (the same integers: zeros from m), in registers (the float weights stored by one pass and
// loaded by the next took ~13% of an int4 attention); returns the sum of e * minimum (int4's bias; 16 lanes, then theirs)
template <int BITS>
inline float fold_weights_8bit(const float* e, const float* scale, const float* minimum, int64_t m, int64_t n,
                               uint8_t* w8, float* dw) {
  __m512 bias = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < n; c0 += WEIGHT_CHUNK) {
    auto [first, second] = chunk_lanes(std::clamp<int64_t>(m - c0, 0, WEIGHT_CHUNK));
    __m512 e0 = _mm512_maskz_loadu_ps(first, e + c0), e1 = _mm512_maskz_loadu_ps(second, e + c0 + 16);
    __m512 x0 = _mm512_mul_ps(e0, _mm512_maskz_loadu_ps(first, scale + c0));
    __m512 x1 = _mm512_mul_ps(e1, _mm512_maskz_loadu_ps(second, scale + c0 + 16));
    if constexpr (BITS == 4) {
      bias = _mm512_fmadd_ps(e0, _mm512_maskz_loadu_ps(first, minimum + c0), bias);
      bias = _mm512_fmadd_ps(e1, _mm512_maskz_loadu_ps(second, minimum + c0 + 16), bias);
    }
    __m512i q0, q1;
    dw[c0 / WEIGHT_CHUNK] = on_8bit_grid(x0, x1, q0, q1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w8 + c0), _mm512_cvtepi32_epi8(q0));  // 0..255: the low bytes
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w8 + c0 + 16), _mm512_cvtepi32_epi8(q1));
  }
  return _mm512_reduce_add_ps(bias);
}

// weigh_int_values' sums by vpdpbusd, four tokens a lane: part_i[2..] = chunk by chunk fma(sums, dw, part_i) + bias_i,
// for the active vectors' softmax weights (vector i's from scores + i * padded, counts[a] of them), each token's
// value scale (int4: and minimum) folded in. tiled: rows in tiles (kv_tiled), the first at position `first`
template <int BITS>
void weigh_values_512(const uint8_t* const* rows, int64_t n, int64_t d, const std::vector<int64_t>& active,
                      const std::vector<int64_t>& counts, const float* scores, int64_t padded, const float* scale,
                      const float* minimum, float* part, int64_t stride, QuantScratch<BITS>& scratch, bool tiled,
                      int64_t first) {
  int64_t regs = d / 16, chunks = (n + WEIGHT_CHUNK - 1) / WEIGHT_CHUNK, nv = active.size();
  auto &w8 = scratch.w8, &quads = scratch.quads;
  auto &dw = scratch.dw, &bias = scratch.bias;
  auto& acc = scratch.acc512;
  w8.resize(nv * chunks * WEIGHT_CHUNK);
  dw.resize(nv * chunks);
  bias.resize(nv);
  acc.resize(nv * regs);
  for (int64_t v = 0; v < nv; ++v) {
    bias[v] = fold_weights_8bit<BITS>(scores + active[v] * padded, scale, minimum, counts[v], n,
                                      w8.data() + v * chunks * WEIGHT_CHUNK, dw.data() + v * chunks);
    const float* out = part + active[v] * stride + 2;
    for (int64_t r = 0; r < regs; ++r) acc[v * regs + r] = _mm512_loadu_ps(out + quad_channel(BITS, r, d));
  }
  quads.resize(WEIGHT_CHUNK / 4 * regs);
  for (int64_t p0 = 0, c = 0; p0 < n; p0 += WEIGHT_CHUNK, ++c) {
    int64_t m = std::min(WEIGHT_CHUNK, n - p0), nq = (m + 3) / 4;
    for (int64_t r = 0; r < nq; ++r) {
      const uint8_t* const* at = rows + p0 + 4 * r;
      if (!tiled) {
        const uint8_t* four[4];
        for (int k = 0; k < 4; ++k) four[k] = 4 * r + k < m ? at[k] : ZERO_CODES;
        quad_codes<BITS>(four, d, quads.data() + r * regs);
      } else if (first % 4 == 0) {  // a quad (a last one's tokens past m: their weights are 0)
        quad_of_tile<BITS>(at[0], d, quads.data() + r * regs);
      } else {
        untiled_quad<BITS>(at, std::min<int64_t>(4, m - 4 * r), first + p0 + 4 * r, d, quads.data() + r * regs);
      }
    }
    for (int64_t v = 0; v < nv; ++v)
      if (dw[v * chunks + c] > 0.f)
        dpbusd_quads_any(quads.data(), w8.data() + v * chunks * WEIGHT_CHUNK + p0, nq, regs, dw[v * chunks + c],
                         acc.data() + v * regs);
  }
  for (int64_t v = 0; v < nv; ++v) {
    const __m512 vbias = _mm512_set1_ps(bias[v]);
    float* out = part + active[v] * stride + 2;
    for (int64_t r = 0; r < regs; ++r)
      _mm512_storeu_ps(out + quad_channel(BITS, r, d), _mm512_add_ps(acc[v * regs + r], vbias));
  }
}
#endif

#ifdef KVSCOPE_AVX2
// every active vector's values over the codes of [qstart, qstart + n) (rows, as stored): weights (float, `stride_w`
// apart, zeros past a vector's last key) -> part_i[2..] = chunk by chunk fma(integer sums, dw, part_i), then + bias_i
template <int BITS>
inline void weigh_int_values(const uint8_t* const* rows, int64_t n, int64_t d, const std::vector<int64_t>& active,
                             const float* weights, int64_t stride_w, const float* bias, float* part, int64_t stride,
                             QuantScratch<BITS>& scratch) {
  int64_t dp = padded_channels(d), regs = dp / 8, chunks = (n + WEIGHT_CHUNK - 1) / WEIGHT_CHUNK, nv = active.size();
  auto& w16 = scratch.w16;
  auto& dw = scratch.dw;
  auto& unpacked = scratch.unpacked;
  auto &pairs = scratch.pairs, &acc = scratch.acc256;
  w16.resize(nv * chunks * WEIGHT_CHUNK);
  dw.resize(nv * chunks);
  for (int64_t v = 0; v < nv; ++v)
    weights_8bit(weights + v * stride_w, n, w16.data() + v * chunks * WEIGHT_CHUNK, dw.data() + v * chunks);
  acc.resize(regs);
  unpacked.resize(2 * PAIRS_AT_ONCE * dp);
  pairs.resize(PAIRS_AT_ONCE * regs);
  const bool as_stored = d % (BITS == 4 ? 2 * CODE_LANES : CODE_LANES) == 0;  // rows interleaved as they are stored
  alignas(32) static const uint8_t zeros[256] = {};  // the partner of a last token alone (codes 0, weight 0)
  for (int64_t p0 = 0, c = 0; p0 < n; p0 += WEIGHT_CHUNK, ++c) {
    int64_t m = std::min(WEIGHT_CHUNK, n - p0), np = (m + 1) / 2;
    if (as_stored) {
      for (int64_t r = 0; r < np; ++r) {
        const uint8_t *a = rows[p0 + 2 * r], *b = 2 * r + 1 < m ? rows[p0 + 2 * r + 1] : zeros;
        if constexpr (BITS == 4) interleave_packed_pair(a, b, d, pairs.data() + r * regs);
        else interleave_pair<BITS>(a, b, dp, pairs.data() + r * regs);
      }
    } else {
      unpack_codes<BITS>(rows + p0, m, d, dp, unpacked.data());
      if (m % 2) std::fill_n(unpacked.data() + m * dp, dp, uint8_t{0});  // a last token alone: paired with zeros
      for (int64_t r = 0; r < np; ++r)
        interleave_pair<BITS>(unpacked.data() + 2 * r * dp, unpacked.data() + (2 * r + 1) * dp, dp, pairs.data() + r * regs);
    }
    for (int64_t v = 0; v < nv; ++v) {
      if (dw[v * chunks + c] == 0.f) continue;
      std::fill(acc.begin(), acc.end(), _mm256_setzero_si256());
      madd_pairs_any(pairs.data(), w16.data() + v * chunks * WEIGHT_CHUNK + p0, np, regs, acc.data());
      fma_sums(acc.data(), d, dw[v * chunks + c], part + active[v] * stride + 2);
    }
  }
  for (int64_t v = 0; v < nv; ++v) add_bias(part + active[v] * stride + 2, d, bias[v]);
}

// ---- values: the codes of a row become floats once, in registers, for NV query vectors at once.
// out_v[j0..j0+8S) += sum over p < n of w_v[p] * code_p[j] in position order per lane (weigh_values' sums)
// channels j..j+7 of a row of codes as floats, where (byte, shift) = code_place<BITS>(j, half): no branch per row
template <int BITS>
inline std::pair<int64_t, int> code_place(int64_t j, int64_t half) {
  if constexpr (BITS == 8) return {j, 0};
  return j < half ? std::pair<int64_t, int>{j, 0} : std::pair<int64_t, int>{j - half, 4};
}

template <int BITS>
inline __m256 codes8_at(const uint8_t* row, int64_t byte, __m128i shift) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + byte));
  if constexpr (BITS == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  b = _mm_and_si128(_mm_srl_epi16(b, shift), _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

template <int BITS, int NV, int S>
inline void weigh_codes_chunk(const float* const* w, const uint8_t* const* rows, int64_t n, int64_t half, int64_t j0,
                              float* const* out) {
  __m256 acc[NV][S];
  int64_t byte[S];
  __m128i shift[S];
  for (int s = 0; s < S; ++s) {
    auto [at, bits] = code_place<BITS>(j0 + 8 * s, half);
    byte[s] = at, shift[s] = _mm_cvtsi32_si128(bits);
    for (int v = 0; v < NV; ++v) acc[v][s] = _mm256_loadu_ps(out[v] + j0 + 8 * s);
  }
  for (int64_t p = 0; p < n; ++p) {
    __m256 c[S];
    for (int s = 0; s < S; ++s) c[s] = codes8_at<BITS>(rows[p], byte[s], shift[s]);
    for (int v = 0; v < NV; ++v) {
      __m256 wv = _mm256_set1_ps(w[v][p]);
      for (int s = 0; s < S; ++s) acc[v][s] = _mm256_fmadd_ps(wv, c[s], acc[v][s]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int s = 0; s < S; ++s) _mm256_storeu_ps(out[v] + j0 + 8 * s, acc[v][s]);
}

template <int BITS, int NV>
void weigh_codes(const float* const* w, const uint8_t* const* rows, int64_t n, int64_t d, float* const* out) {
  int64_t j0 = 0, half = d / 2;
  for (; j0 + 32 <= d; j0 += 32) weigh_codes_chunk<BITS, NV, 4>(w, rows, n, half, j0, out);
  for (; j0 < d; j0 += 8) weigh_codes_chunk<BITS, NV, 1>(w, rows, n, half, j0, out);
}
#endif

// Reading a tile's codes from memory costs latency more than bandwidth (a row of int4 codes is 32 bytes for a
// head of 64): while a block's keys are scored, the codes and scales of the positions PREFETCH_AHEAD further on
// (the next tile's too) are fetched, the keys' into L1. int8's values (read after the softmax) go to L2, where they
// wait for the value phase: where that phase fetched its own codes into L1 64 positions ahead, whole int8 steps at
// 4,096 tokens took 5-7% longer on one thread and two in the VM's slower phases, the same in its faster ones (Xeon
// model 167, alternating). int4's fewer value lines go to L1 with the keys' (into L2: no faster).
constexpr int64_t PREFETCH_AHEAD = 64;

inline int64_t key_param_bytes(int bits, int64_t d) { return bits == 8 ? 2 * d : 2 * d + 4; }
constexpr int64_t MAX_QUANT_BLOCK = 256;  // tokens a quantized block holds at most (a block's rows on the stack)


// the codes and scales of positions [a, b), a block (one set of key scales, adjacent rows of `bytes`) at a time
template <int BITS>
inline void prefetch_codes(const QuantRows<BITS>& keys, const QuantRows<BITS>& values, int64_t a, int64_t b,
                           int64_t bytes, int64_t d, Prefetches* later = nullptr) {
  auto fetch = [&](const void* from, const void* to) {  // now, or queued in `later`
    if (later) later->add(from, to);
    else prefetch_span(from, to, _MM_HINT_T0);
  };
  b = std::min(b, keys.known);
  for (int64_t s = a, e = a; s < b; s = e) {
    const uint16_t* prm = keys.key_param(s);
    e = keys.block_end(s, b);
    int64_t n = e - s;
    fetch(keys.key_row(s), keys.key_row(s) + n * bytes);
    fetch(prm, reinterpret_cast<const char*>(prm) + key_param_bytes(BITS, d));
    const uint8_t* v = values.code[s - values.first];
    if (spread_prefetches(BITS, d)) prefetch_span(v, v + n * bytes, _MM_HINT_T1);
    else fetch(v, v + n * bytes);
    fetch(values.param[s - values.first], values.param[e - 1 - values.first] + 1);
  }
}

// f(take, NV) for the vectors that see a block starting at `from` (from <= last[i]), up to three at a time
template <typename F>
__attribute__((always_inline)) inline void seeing_threes(const int64_t* last, int64_t nq, int64_t from, F f) {
  for (int64_t i = 0; i < nq;) {
    int64_t take[3], nv = 0;
    for (; i < nq && nv < 3; ++i)
      if (from <= last[i]) take[nv++] = i;
    in_threes(nv, [&](int64_t, auto count) { f(take, count); });
  }
}

// the vectors that see a block from `from` on, three at a time: each put on its integer grid in its own slot (dp
// apart; prepare(vector, slot, &bias) returns its step), then score(count, slots, steps, biases, where each vector's
// scores of the block go)
template <typename Q, typename Prepare, typename Score>
__attribute__((always_inline)) inline void score_seeing_threes(const float* q, int64_t d, int64_t dp,
                                                               const int64_t* last, int64_t nq, int64_t from, Q* slots,
                                                               float* scores, int64_t padded, Prepare prepare,
                                                               Score score) {
  seeing_threes(last, nq, from, [&](const int64_t* take, auto count) {
    constexpr int NV = decltype(count)::value;
    const Q* qv[NV];
    float dq[NV], bias[NV], *out[NV];
    for (int v = 0; v < NV; ++v) {
      Q* slot = slots + v * dp;
      dq[v] = prepare(q + take[v] * d, slot, bias + v);
      qv[v] = slot, out[v] = scores + take[v] * padded + from;
    }
    score(count, qv, dq, bias, out);
  });
}

// the scores of every vector against one block of codes [s, e) (one set of key scales `prm`): AVX2 reads the codes
// where they lie for the common head sizes (score_int8_rows, score_int4_rows), else from a widened or unpacked copy
template <int BITS>
inline void score_int_block(const float* q, const uint8_t* const* code, const uint16_t* prm, const int64_t* last,
                             int64_t nq, int64_t d, int64_t s, int64_t e, int64_t k0, float* scores, int64_t padded,
                            Prefetches* ahead, QuantScratch<BITS>& scratch, bool tiled) {
#ifdef KVSCOPE_KV512
  if (kv512_keys(BITS, d))
    return score_block_512_any<BITS>(q, code, prm, last, nq, d, s, e, k0, scores, padded, ahead, tiled);
#endif
  ahead->issue(ahead->left());
#ifdef KVSCOPE_AVX2
  auto& qs = scratch.qs;
  auto& unpacked = scratch.unpacked;
  auto &wide = scratch.wide, &qi = scratch.qi;
  int64_t dp = padded_channels(d);
  qs.resize(dp);
  TORCH_CHECK(d <= 256, "quantized keys: head_dim up to 256");
  alignas(32) float sc[256], mn[256];  // the block's key scales and minimums as floats, once for every vector
  for (int64_t j = 0; j < d; j += 8) {
    auto [scale, minimum] = key_params8<BITS>(prm, d, j);
    _mm256_store_ps(sc + j, scale), _mm256_store_ps(mn + j, minimum);
  }
  if constexpr (BITS == 4) {  // codes as bytes against a one-part int8 query
    auto& qb = scratch.qb;
    if (int4_rows_fit(d)) {  // straight from the packed rows, the vectors that see this block three at a time
      qb.resize(3 * dp);
      score_seeing_threes(
          q, d, dp, last, nq, s - k0, qb.data(), scores, padded,
          [&](const float* v, int8_t* slot, float* bias) {
            return query_int8(v, sc, mn, d, dp, qs.data(), slot, bias);
          },
          [&](auto count, const int8_t* const* qv, const float* dq, const float* bias, float* const* out) {
            constexpr int NV = decltype(count)::value;
            if (d == 64) score_int4_rows<1, NV>(code, e - s, qv, dq, bias, out);
            else score_int4_rows<2, NV>(code, e - s, qv, dq, bias, out);
          });
      return;
    }
    unpacked.resize((e - s) * dp);
    unpack_codes<BITS>(code, e - s, d, dp, unpacked.data());
    qb.resize(dp);
    for (int64_t i = 0; i < nq; ++i) {
      if (s - k0 > last[i]) continue;
      float bias, dq = query_int8(q + i * d, sc, mn, d, dp, qs.data(), qb.data(), &bias);
      score_nibbles(unpacked.data(), e - s, dp, qb.data(), dq, bias, scores + i * padded + s - k0);
    }
    return;
  }
  if (int8_rows_fit(d)) {  // the vectors that see this block, three at a time
    qi.resize(3 * dp);
    score_seeing_threes(
        q, d, dp, last, nq, s - k0, qi.data(), scores, padded,
        [&](const float* v, int16_t* slot, float* bias) {
          return query_int16(v, sc, mn, d, dp, qs.data(), slot, bias);
        },
        [&](auto count, const int16_t* const* qv, const float* dq, const float* bias, float* const* out) {
          score_int8_rows_any<decltype(count)::value>(code, e - s, d, qv, dq, bias, out);
        });
    return;
  }
  wide.resize((e - s) * dp);
  qi.resize(dp);
  if (d % 16 == 0) {
    widen_int8_rows(code, e - s, d, dp, wide.data());
  } else {
    unpacked.resize((e - s) * dp);
    unpack_codes<BITS>(code, e - s, d, dp, unpacked.data());
    for (int64_t i = 0; i < (e - s) * dp; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide.data() + i),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unpacked.data() + i))));
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (s - k0 > last[i]) continue;
    float bias, dq = query_int16(q + i * d, sc, mn, d, dp, qs.data(), qi.data(), &bias);
    score_codes(wide.data(), e - s, dp, qi.data(), dq, bias, scores + i * padded + s - k0);
  }
#endif
}

// as score_int_block, from the block's codes turned into floats once (without AVX2)
template <int BITS>
void score_block_floats(const float* q, const uint8_t* const* code, const uint16_t* prm, const int64_t* last,
                        int64_t nq, int64_t d, int64_t s, int64_t e, int64_t k0, float* scores, int64_t padded,
                        QuantScratch<BITS>& scratch) {
  auto &qs = scratch.qs, &raw = scratch.raw;
  auto& raw_rows = scratch.raw_rows;
  qs.resize(d);
  raw.resize((e - s) * d);
  raw_rows.resize(e - s);
  codes_to_floats<BITS>(code, e - s, d, raw.data());
  for (int64_t p = 0; p < e - s; ++p) raw_rows[p] = raw.data() + p * d;
  for (int64_t i = 0; i < nq; ++i) {
    if (s - k0 > last[i]) continue;
    float bias = scale_query<BITS>(q + i * d, prm, d, qs.data());
    int64_t m = std::min(e, k0 + last[i] + 1) - s;
    float* out = scores + i * padded + s - k0;
    score_keys(qs.data(), raw_rows.data(), m, d, out);
    for (int64_t p = 0; p < m; ++p) out[p] += bias;
  }
}

// The full-precision rows this tile or a later one reads after the codes: at tile 0 the sink's, and at every tile
// but the last a share of the window's (the last tile reads them): fetched into L2 while the codes are scored, a
// part each block (measured: the window's float rows came from memory, ~10% of int4's attention)
struct LaterRows {
  int64_t sink = 0, w0 = 0, w1 = 0, done = 0;  // positions [0, sink) and [w0, w1); how many are fetched
  int64_t count() const { return sink + w1 - w0; }
  template <int BITS>
  void fetch(const QuantRows<BITS>& keys, const QuantRows<BITS>& values, int64_t d, int64_t upto) {
    for (; done < upto; ++done) {
      int64_t p = done < sink ? done : w0 + done - sink;
      int64_t row = p < keys.sink ? p : p % keys.ring;  // (keys and values share the sink and the ring's length)
      const WindowRow<BITS>* k = (p < keys.sink ? keys.sink_rows : keys.window) + row * d;
      const WindowRow<BITS>* v = (p < keys.sink ? values.sink_rows : values.window) + row * d;
      prefetch_span(k, k + d, _MM_HINT_T1);
      prefetch_span(v, v + d, _MM_HINT_T1);
    }
  }
};

template <int BITS>
LaterRows later_rows(const QuantRows<BITS>& keys, int64_t k0, int64_t qstart) {
  LaterRows r;
  int64_t tiles = (keys.end + KEY_TILE - 1) / KEY_TILE, t = k0 / KEY_TILE, n = keys.end - keys.full;
  if (k0 == 0) r.sink = std::min(keys.sink, qstart);
  if (t + 1 < tiles) r.w0 = keys.full + n * t / (tiles - 1), r.w1 = keys.full + n * (t + 1) / (tiles - 1);
  return r;
}

// the scores of every vector against the codes of [qstart, qend), block by block (one set of key scales each)
template <int BITS>
void score_quantized(const float* q, const QuantRows<BITS>& keys, const QuantRows<BITS>& values, const int64_t* last,
                     int64_t nq, int64_t d, int64_t k0, int64_t qstart, int64_t qend, float* scores, int64_t padded) {
  constexpr bool INTEGER = KVSCOPE_INT_DOTS;
  QuantScratch<BITS>& scratch = *keys.scratch;
  LaterRows later = later_rows(keys, k0, qstart);
  Prefetches ahead;  // the lines of the positions PREFETCH_AHEAD on, issued while a block is scored (on the stack:
                     // a thread_local's address is a call into the loader, which the compiler repeats in loops)
  const uint8_t* rows[MAX_QUANT_BLOCK];
  const int64_t share = (later.count() << 16) / std::max<int64_t>(1, qend - qstart);  // rows a position, in 65,536ths
  for (int64_t s = qstart, e = qstart; s < qend; s = e) {
    const uint16_t* prm = keys.key_param(s);
    e = keys.block_end(s, qend);
    later.fetch(keys, values, d, e == qend ? later.count() : (e - qstart) * share >> 16);
    if (s == qstart) prefetch_codes(keys, values, s, s + PREFETCH_AHEAD, d * BITS / 8, d);
    ahead.clear();
    // int8: queued, spread over the block's scoring (int4's fewer lines: at once, measured faster)
    prefetch_codes(keys, values, s + PREFETCH_AHEAD, e + PREFETCH_AHEAD, d * BITS / 8, d,
                   spread_prefetches(BITS, d) ? &ahead : nullptr);
    fill_addresses(keys.key_row(s), keys.row_bytes, e - s, rows);  // the block's rows, where the scorers read them
    const uint8_t* const* code = rows;
    if constexpr (INTEGER)
      score_int_block<BITS>(q, code, prm, last, nq, d, s, e, k0, scores, padded, &ahead, scratch, keys.tiled);
    else ahead.issue(ahead.left()), score_block_floats<BITS>(q, code, prm, last, nq, d, s, e, k0, scores, padded, scratch);
    ahead.issue(ahead.left());
  }
}

// for V vectors of m weights each: w_v[p] = e_v[p] * scale[p] for p < m, 0 up to `even`; bias[v] = the sum of
// e_v[p] * minimum[p] (8 lanes, then theirs). Each vector's bias is one chain of FMAs: V of them side by side
// (one alone waited on the FMA's latency)
template <int V>
inline void fold_weights(const float* const* e, const float* scale, const float* minimum, int64_t m, int64_t even,
                         float* const* w, float* bias) {
  int64_t p = 0;
  float tail[V] = {};
#ifdef KVSCOPE_AVX2
  __m256 b[V];
  for (int v = 0; v < V; ++v) b[v] = _mm256_setzero_ps();
  for (; p + 8 <= m; p += 8) {
    __m256 sc = _mm256_loadu_ps(scale + p), mn = _mm256_loadu_ps(minimum + p);
    for (int v = 0; v < V; ++v) {
      __m256 ev = _mm256_loadu_ps(e[v] + p);
      _mm256_storeu_ps(w[v] + p, _mm256_mul_ps(ev, sc));
      b[v] = _mm256_fmadd_ps(ev, mn, b[v]);
    }
  }
  for (int v = 0; v < V; ++v) tail[v] = hsum(b[v]);
#endif
  for (int v = 0; v < V; ++v) {
    for (int64_t q = p; q < m; ++q) w[v][q] = e[v][q] * scale[q], tail[v] += e[v][q] * minimum[q];
    std::fill(w[v] + m, w[v] + even, 0.f);
    bias[v] = tail[v];
  }
}

// n tokens' value scales (int4: and minimums) as floats; params[p]: token p's float16 scale (int4: then its
// minimum), eight at a time where eight tokens' sit side by side (in one block)
template <int BITS>
inline void value_params(const uint16_t* const* params, int64_t n, float* scale, float* minimum) {
  constexpr int64_t STEP = BITS == 4 ? 2 : 1;  // float16 values a token
  auto one = [&](int64_t p) {
    scale[p] = half_to_float(params[p][0]);
    if constexpr (BITS == 4) minimum[p] = half_to_float(params[p][1]);
  };
  int64_t p = 0;
#ifdef KVSCOPE_AVX2
  for (; p + 8 <= n; p += 8) {
    const uint16_t* at = params[p];
    if (params[p + 7] != at + 7 * STEP) {  // across blocks
      for (int64_t r = p; r < p + 8; ++r) one(r);
      continue;
    }
    if constexpr (BITS == 8) {
      _mm256_storeu_ps(scale + p, halves8(at));
    } else {
      __m256 a = halves8(at), b = halves8(at + 8);  // s0 m0 s1 m1 .. s3 m3, then s4 m4 .. s7 m7
      auto in_order = [](__m256 x) {  // 64-bit lanes 0 2 1 3 -> 0 1 2 3
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
      };
      _mm256_storeu_ps(scale + p, in_order(_mm256_shuffle_ps(a, b, 0x88)));    // s0 s1 s4 s5 | s2 s3 s6 s7
      _mm256_storeu_ps(minimum + p, in_order(_mm256_shuffle_ps(a, b, 0xDD)));
    }
  }
#endif
  for (; p < n; ++p) one(p);
}

// the values of [qstart, qend) weighted by the softmax weights e (a token's scale folded into its weight, its
// minimum into a bias per vector): part_i[2..] += sum over p of e_i[p] * (scale_p * code_p + min_p)
template <int BITS>
void weigh_quantized(const float* scores, int64_t padded, const QuantRows<BITS>& values, const int64_t* last,
                     int64_t nq, int64_t d, int64_t k0, int64_t qstart, int64_t qend, float* part) {
  int64_t n = qend - qstart, even = (n + 1) / 2 * 2, stride = d + 2;
  QuantScratch<BITS>& scratch = *values.scratch;
  auto &scale = scratch.scale, &minimum = scratch.minimum, &weights = scratch.weights, &bias = scratch.bias;
  auto &active = scratch.active, &counts = scratch.counts;
  scale.assign(even, 0.f);
  minimum.assign(even, 0.f);
  value_params<BITS>(values.param + (qstart - values.first), n, scale.data(), minimum.data());
  active.clear();  // the vectors that weigh any of these positions, and how many each weighs
  counts.clear();
  for (int64_t i = 0; i < nq; ++i)
    if (qstart - k0 <= last[i]) active.push_back(i), counts.push_back(std::min(n, k0 + last[i] + 1 - qstart));
  const int64_t upto = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  const float* from = scores + qstart - k0;
  const uint8_t* const* rows = values.code + (qstart - values.first);
#ifdef KVSCOPE_KV512
  if (KVSCOPE_INT_DOTS && kv512_values(BITS, d))
    return weigh_values_512<BITS>(rows, upto, d, active, counts, from, padded,
                                  scale.data(), minimum.data(), part, stride, scratch, values.tiled, qstart);
#endif
  weights.resize(active.size() * even);
  bias.resize(active.size());
  for (size_t a = 0, run; a < active.size(); a += run) {  // vectors of one count (one query row's) fold three at a time
    for (run = 1; a + run < active.size() && counts[a + run] == counts[a];) ++run;
    in_threes(run, [&](int64_t b, auto nv) {
      constexpr int V = decltype(nv)::value;
      const float* e[V];
      float* w[V];
      for (int v = 0; v < V; ++v) e[v] = from + active[a + b + v] * padded, w[v] = weights.data() + (a + b + v) * even;
      fold_weights<V>(e, scale.data(), minimum.data(), counts[a], even, w, bias.data() + a + b);
    });
  }
#ifdef KVSCOPE_AVX2
  if constexpr (KVSCOPE_INT_DOTS)
    return weigh_int_values<BITS>(rows, upto, d, active, weights.data(), even, bias.data(), part, stride, scratch);
  for (size_t a = 0; a < active.size(); a += 3) {  // three vectors at a time: 12 accumulators of 8 lanes
    const float* w[3];
    float* out[3];
    int64_t nv = std::min<int64_t>(3, active.size() - a);
    for (int64_t v = 0; v < nv; ++v) w[v] = weights.data() + (a + v) * even, out[v] = part + active[a + v] * stride + 2;
    if (nv == 3) weigh_codes<BITS, 3>(w, rows, upto, d, out);
    if (nv == 2) weigh_codes<BITS, 2>(w, rows, upto, d, out);
    if (nv == 1) weigh_codes<BITS, 1>(w, rows, upto, d, out);
  }
#else
  auto& raw = scratch.raw;
  auto& raw_rows = scratch.raw_rows;
  raw.resize(upto * d);
  raw_rows.resize(upto);
  codes_to_floats<BITS>(rows, upto, d, raw.data());
  for (int64_t r = 0; r < upto; ++r) raw_rows[r] = raw.data() + r * d;
  for (size_t a = 0; a < active.size(); ++a) {
    float* out = part + active[a] * stride + 2;
    weigh_values(weights.data() + a * even, raw_rows.data(), upto, out, d);
    for (int64_t j = 0; j < d; ++j) out[j] += bias[a];
  }
#endif
}

// as the float attend_tile: the sink's rows, the codes of [sink, full) block by block, then the window's rows
template <int BITS>
void attend_tile(const float* q, float* part, const QuantRows<BITS>& keys, const QuantRows<BITS>& values,
                 const int32_t* pos, int64_t rows, int64_t group, int64_t d, int64_t k0, int64_t k1) {
  int64_t n = k1 - k0, padded = (n + 7) / 8 * 8, nq = rows * group, stride = d + 2;
  int64_t qstart = std::clamp(keys.sink, k0, k1), qend = std::clamp(keys.full, qstart, k1);  // codes: [qstart, qend)
  QuantScratch<BITS>& scratch = *keys.scratch;
  auto& scores = scratch.scores;
  auto &window_k = scratch.window_k, &window_v = scratch.window_v;
  auto& last = scratch.last;  // each vector's last key in this tile, from k0
  scores.resize(nq * padded);  // every score up to a vector's last key is written, the rest set by its softmax
  last.resize(nq);
  for (int64_t i = 0; i < nq; ++i) last[i] = std::min<int64_t>(pos[i / group], k1 - 1) - k0;
  score_quantized<BITS>(q, keys, values, last.data(), nq, d, k0, qstart, qend, scores.data(), padded);
  // full-precision rows: the sink's [k0, qstart), the window's [qend, k1), each scored in position order
  window_k.resize(n);
  window_v.resize(n);
  const WindowRow<BITS>**wk = window_k.data(), **wv = window_v.data();
  for (int64_t p = k0; p < qstart; ++p) wk[p - k0] = keys.sink_rows + p * d, wv[p - k0] = values.sink_rows + p * d;
  for (int64_t p = qend, row = qend % keys.ring; p < k1; ++p, row = row + 1 == keys.ring ? 0 : row + 1) {
    wk[p - k0] = keys.window + row * d;  // (keys and values share the ring's length)
    wv[p - k0] = values.window + row * d;
  }
  for (auto [a, b] : {std::pair{k0, qstart}, std::pair{qend, k1}})  // a row's group of vectors at once
    for (int64_t r = 0; r < rows; ++r) {
      int64_t lr = last[r * group], m = std::min(b, k0 + lr + 1) - a;
      for (int64_t p = 0; p < m; p += 4)
        score_group(q + r * group * d, group, d, window_k.data() + (a - k0) + p, std::min<int64_t>(4, m - p),
                    scores.data() + r * group * padded + a - k0 + p, padded);
    }
  start_partials(part, scores.data(), last.data(), nq, padded, d);
  for (int64_t r = 0; r < rows; ++r)
    if (qstart > k0 && 0 <= last[r * group])
      weigh_group(scores.data() + r * group * padded, padded, group, window_v.data(),
                  std::min(qstart, k0 + last[r * group] + 1) - k0, part + r * group * stride + 2, stride, d);
  if (qstart < qend) weigh_quantized<BITS>(scores.data(), padded, values, last.data(), nq, d, k0, qstart, qend, part);
  for (int64_t r = 0; r < rows; ++r)
    if (qend < k1 && qend - k0 <= last[r * group])
      weigh_group(scores.data() + r * group * padded + qend - k0, padded, group, window_v.data() + (qend - k0),
                  k0 + last[r * group] + 1 - qend, part + r * group * stride + 2, stride, d);
}


// the partials of one query vector over its tiles, in tile order -> out [D]
inline void combine_tiles(const float* parts, int64_t tiles, int64_t tile_stride, float* out, int64_t d) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < tiles; ++t) mx = std::max(mx, parts[t * tile_stride]);
  std::fill_n(out, d, 0.f);
  if (mx == -std::numeric_limits<float>::infinity()) return;  // a padding row: no keys
  float total = 0.f;
  for (int64_t t = 0; t < tiles; ++t) {
    const float* pt = parts + t * tile_stride;
    if (pt[1] == 0.f) continue;
    float w = std::exp(pt[0] - mx);
    total += w * pt[1];
    for (int64_t j = 0; j < d; ++j) out[j] += w * pt[2 + j];
  }
  for (int64_t j = 0; j < d; ++j) out[j] /= total;
}

struct StepMap {  // where a step's keys are: see `attention` below
  const int32_t *table, *block_store, *block_start, *q_pos;
  int64_t width, block_size, t;
  int block_shift = -1;  // log2(block_size) where it is a power of two, else -1 (in_blocks)
  int64_t blocks(int64_t x) const { return in_blocks(x, block_shift, block_size); }
  int64_t kv_len(int64_t b) const {
    int64_t last = -1;
    for (int64_t r = 0; r < t; ++r) last = std::max<int64_t>(last, q_pos[b * t + r]);
    return last + 1;
  }
  // calls visit(p0, p1, store, slot of p0) for the runs [p0, p1) of positions k0..k1-1 of sequence b, one a block
  template <typename Visit>
  void each_block(int64_t b, int64_t k0, int64_t k1, Visit visit) const {
    for (int64_t p0 = blocks(k0) * block_size, i = blocks(k0); p0 < k1; p0 += block_size, ++i) {
      int64_t blk = table[b * width + i], first = std::max(p0, k0);
      visit(first, std::min(k1, p0 + block_size), block_store[blk], block_start[blk] + first - p0);
    }
  }
  // as each_block, one visit for each run of blocks that sit one after another in one store (a pool's blocks
  // mostly do: a tile of 256 keys is then one run, where it was 16 visits of blocks of 16)
  template <typename Visit>
  void each_run(int64_t b, int64_t k0, int64_t k1, Visit visit) const {
    int64_t r0 = k0, r1 = k0, store = -1, slot = 0;  // the run [r0, r1) so far, from `slot` of `store`
    each_block(b, k0, k1, [&](int64_t p0, int64_t p1, int64_t st, int64_t sl) {
      if (st == store && sl == slot + (p0 - r0)) return void(r1 = p1);
      if (r1 > r0) visit(r0, r1, store, slot);
      r0 = p0, r1 = p1, store = st, slot = sl;
    });
    if (r1 > r0) visit(r0, r1, store, slot);
  }
};

// the address of (head, slot) in each store, without touching the tensors in the hot loop
template <typename T>
struct StoreAddresses {  // in place up to 16 stores: a step builds a dozen of these a layer (measured: their heap
  c10::SmallVector<const T*, 16> base;  // vectors were 1.2% of an int8 step at 512 tokens in malloc and free)
  c10::SmallVector<int64_t, 16> head_stride, slot_stride;
  StoreAddresses(at::TensorList stores) {  // NOLINT: implicit, for aggregate initialisation
    base.reserve(stores.size()), head_stride.reserve(stores.size()), slot_stride.reserve(stores.size());
    for (const auto& s : stores) {
      base.push_back(static_cast<const T*>(s.data_ptr()));  // dtypes are checked by the callers
      head_stride.push_back(s.stride(0));
      slot_stride.push_back(s.dim() > 1 ? s.stride(1) : 1);
    }
  }
  const T* at(int64_t store, int64_t h, int64_t slot) const {
    return base[store] + h * head_stride[store] + slot * slot_stride[store];
  }
};

StepMap step_map(const at::Tensor& table, const at::Tensor& block_store, const at::Tensor& block_start,
                 int64_t block_size, const at::Tensor& q_pos) {
  TORCH_CHECK(table.scalar_type() == at::kInt && block_store.scalar_type() == at::kInt &&
                  block_start.scalar_type() == at::kInt && q_pos.scalar_type() == at::kInt &&
                  table.is_contiguous() && q_pos.is_contiguous(),
              "tables are contiguous int32");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  bool pow2 = (block_size & (block_size - 1)) == 0;
  return {table.data_ptr<int32_t>(), block_store.data_ptr<int32_t>(), block_start.data_ptr<int32_t>(),
          q_pos.data_ptr<int32_t>(), table.size(1), block_size, q_pos.size(1),
          pow2 ? __builtin_ctzll(static_cast<uint64_t>(block_size)) : -1};
}

// the thread's buffer for a task's query vectors, scaled
inline std::vector<float>& scaled_queries() {
  thread_local std::vector<float> qg;
  return qg;
}

// tasks: (sequence, KV head, 16 query rows, key tile); make_rows(b, h, k0, k1) -> (key rows, value rows). The task
// that finishes a unit's (sequence, row group, KV head) last tile combines the unit's partials, in tile order
// whichever threads computed them (the same bits). Combined by the caller after the tasks, on two threads, the other
// core's partials crossed to it alone: 4.4-5.2 us a layer at 4,096 tokens (2.0 us on one thread); in the tasks, a
// two-thread step's serial cycles went 1.35M -> 1.05M (int4 KV) and 1.17M -> 0.90M (bfloat16; Xeon, rdtsc)
template <typename MakeRows>
at::Tensor run_attention(const at::Tensor& q, const StepMap& map, const MakeRows& make_rows) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, Hq, T, D] float32");
  TORCH_CHECK(q.size(3) % 8 == 0, "head_dim must be a multiple of 8");
  int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3);
  TORCH_CHECK(map.t == t, "q_pos must be [B, T]");
  auto out = fresh_tensor({b, t, hq * d}, q.options());  // the layout the output projection reads
  float scale = 1.f / std::sqrt(static_cast<float>(d));
  constexpr int64_t ROWS = 16;
  int64_t row_groups = (t + ROWS - 1) / ROWS, hkv = make_rows.num_kv_heads(), group = hq / hkv;
  int64_t vectors = std::min(ROWS, t) * group, stride = d + 2;  // query vectors of a task at most
  // (sequence, row group, KV head); last: the row group's last position (its tasks' key range ends there)
  struct Unit { int64_t b, h, r0, rows, last, tiles, first_part; };
  struct Work { int64_t unit, tile; };
  c10::SmallVector<Unit, 8> units;  // (in place for a decode step's heads, and its tiles up to ~4,000 tokens)
  c10::SmallVector<Work, 64> work;
  int64_t parts = 0;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t g = 0; g < row_groups; ++g) {
      int64_t r0 = g * ROWS, rows = std::min(ROWS, t - r0), last = -1;
      for (int64_t r = 0; r < rows; ++r) last = std::max<int64_t>(last, map.q_pos[bi * t + r0 + r]);
      int64_t tiles = (last + KEY_TILE) / KEY_TILE;  // 0 for a group of padding rows
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t tile = 0; tile < tiles; ++tile) work.push_back({static_cast<int64_t>(units.size()), tile});
        units.push_back({bi, h, r0, rows, last, tiles, parts});
        parts += tiles;
      }
    }
  std::unique_ptr<float[]> partials(new float[parts * vectors * stride]);  // each task starts its own (no zeros)
  std::unique_ptr<std::atomic<int64_t>[]> finished(new std::atomic<int64_t>[units.size()]);
  float* ob = out.data_ptr<float>();
  auto combine = [&](const Unit& u) {
    const float* base = partials.get() + u.first_part * vectors * stride;
    for (int64_t r = 0; r < u.rows; ++r)
      for (int64_t j = 0; j < group; ++j)
        combine_tiles(base + (r * group + j) * stride, u.tiles, vectors * stride,
                      ob + ((u.b * t + u.r0 + r) * hq + u.h * group + j) * d, d);
  };
  for (size_t i = 0; i < units.size(); ++i) {
    finished[i].store(0, std::memory_order_relaxed);
    if (units[i].tiles == 0) combine(units[i]);  // padding rows: zeros
  }
  const float* qb = q.data_ptr<float>();
  const Unit* unit_of = units.data();  // (plain pointers in the tasks)
  const Work* tasks_of = work.data();
  parallel_tapered(static_cast<int64_t>(work.size()), [&](int64_t w0, int64_t w1) {
    std::vector<float>& qg = scaled_queries();  // (looked up once a chunk of tasks)
    for (int64_t w = w0; w < w1; ++w) {
      const Unit& u = unit_of[tasks_of[w].unit];
      const int32_t* pos = map.q_pos + u.b * t + u.r0;
      int64_t k0 = tasks_of[w].tile * KEY_TILE, k1 = std::min(u.last + 1, k0 + KEY_TILE);
      auto [keys, values] = make_rows(u.b, u.h, k0, k1);
      qg.assign(u.rows * group * d, 0.f);
      for (int64_t r = 0; r < u.rows; ++r)
        for (int64_t j = 0; j < group; ++j) {
          const float* src = qb + ((u.b * hq + u.h * group + j) * t + u.r0 + r) * d;
          for (int64_t e = 0; e < d; ++e) qg[(r * group + j) * d + e] = src[e] * scale;
        }
      attend_tile(qg.data(), partials.get() + (u.first_part + tasks_of[w].tile) * vectors * stride, keys, values,
                  pos, u.rows, group, d, k0, k1);
      // the last tile's task sees every other tile's partials (acquire-release on the count)
      if (finished[tasks_of[w].unit].fetch_add(1, std::memory_order_acq_rel) + 1 == u.tiles) combine(u);
    }
  });
  return out;
}

template <typename T>
struct FloatStores {
  StoreAddresses<T> k, v;
  const StepMap& map;
  int64_t hkv;
  int64_t num_kv_heads() const { return hkv; }
  // the rows of tile [k0, k1) of sequence b, head h, a block at a time (a block's rows are a stride apart)
  std::pair<StoreRows<T>, StoreRows<T>> operator()(int64_t b, int64_t h, int64_t k0, int64_t k1) const {
    thread_local std::vector<const T*> k_at, v_at;
    k_at.resize(k1 - k0), v_at.resize(k1 - k0);
    const T** kat = k_at.data();  // (a thread_local's address is a call: looked up once)
    const T** vat = v_at.data();
    map.each_run(b, k0, k1, [&](int64_t p0, int64_t p1, int64_t store, int64_t slot) {
      fill_addresses(k.at(store, h, slot), k.slot_stride[store], p1 - p0, kat + (p0 - k0));
      fill_addresses(v.at(store, h, slot), v.slot_stride[store], p1 - p0, vat + (p0 - k0));
    });
    return {StoreRows<T>{k0, kat}, StoreRows<T>{k0, vat}};
  }
};

template <typename T>
void write_rows(const StoreAddresses<T>& at_, const at::Tensor& x, const int32_t* store_of, const int32_t* slot_of) {
  int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const float* src = x.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti) {
      int64_t store = store_of[bi * t + ti], slot = slot_of[bi * t + ti];
      if (store < 0) continue;
      for (int64_t hi = 0; hi < h; ++hi) {
        put_row(src + ((bi * h + hi) * t + ti) * d, d, const_cast<T*>(at_.at(store, hi, slot)));
      }
    }
}

void check_stores(at::TensorList stores, at::ScalarType dtype, int64_t dims, const char* what) {
  TORCH_CHECK(!stores.empty(), what, ": at least one store");
  for (const auto& s : stores)
    TORCH_CHECK(s.dim() == dims && s.stride(-1) == 1 && s.scalar_type() == dtype, what,
                ": stores of one dtype with contiguous rows");
}

// a float cache's key and value stores: their one dtype
at::ScalarType check_float_stores(at::TensorList k_stores, at::TensorList v_stores) {
  TORCH_CHECK(k_stores.size() == v_stores.size(), "one value store per key store");
  auto dtype = k_stores.empty() ? at::kFloat : k_stores[0].scalar_type();
  check_stores(k_stores, dtype, 3, "keys");
  check_stores(v_stores, dtype, 3, "values");
  return dtype;
}

// a step's new keys and values, as every KV write reads them
void check_new_kv(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "k, v: contiguous float32 [B, Hkv, T, D]");
}

void check_float_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& store_of,
                       const at::Tensor& slot_of) {
  check_new_kv(k, v);
  TORCH_CHECK(store_of.scalar_type() == at::kInt && slot_of.scalar_type() == at::kInt && store_of.is_contiguous() &&
                  slot_of.is_contiguous() && store_of.numel() == k.size(0) * k.size(2) &&
                  slot_of.numel() == store_of.numel(),
              "store_of, slot_of: int32 [B, T]");
}

// f(T{}) for the stores' element type T
template <typename F>
decltype(auto) with_store_type(at::ScalarType dtype, F f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "stores must be float32, bfloat16 or float16");
  }
}

// a step's new keys and values k, v: [B, Hkv, T, D] float32 into their stores: token t of sequence b goes to
// store store_of[b, t], slot slot_of[b, t] (store -1: a padding token, not written)
void write_kv(at::TensorList k_stores, at::TensorList v_stores, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& store_of, const at::Tensor& slot_of) {
  check_float_write(k, v, store_of, slot_of);
  auto dtype = check_float_stores(k_stores, v_stores);
  const int32_t *st = store_of.data_ptr<int32_t>(), *sl = slot_of.data_ptr<int32_t>();
  with_store_type(dtype, [&](auto element) {
    using T = decltype(element);
    write_rows(StoreAddresses<T>(k_stores), k, st, sl);
    write_rows(StoreAddresses<T>(v_stores), v, st, sl);
  });
}

// q: [B, Hq, T, D] float32; stores [Hkv, slots, D] (float32, bfloat16 or float16); token p of sequence b sits in
// store block_store[blk], slot block_start[blk] + p % block_size, blk = table[b, p / block_size]; q_pos: [B, T]
at::Tensor attention(const at::Tensor& q, at::TensorList k_stores, at::TensorList v_stores,
                     const at::Tensor& table, const at::Tensor& block_store, const at::Tensor& block_start,
                     int64_t block_size, const at::Tensor& q_pos) {
  auto dtype = check_float_stores(k_stores, v_stores);
  StepMap map = step_map(table, block_store, block_start, block_size, q_pos);
  return with_store_type(dtype, [&](auto element) {
    using T = decltype(element);
    return run_attention(q, map, FloatStores<T>{{k_stores}, {v_stores}, map, k_stores[0].size(0)});
  });
}

// write_kv then attention, the stores checked and their addresses found once for both (the one-call layer)
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList k_stores,
                            at::TensorList v_stores, const at::Tensor& table, const at::Tensor& block_store,
                            const at::Tensor& block_start, int64_t block_size, const at::Tensor& q_pos,
                            const at::Tensor& store_of, const at::Tensor& slot_of) {
  check_float_write(k, v, store_of, slot_of);
  auto dtype = check_float_stores(k_stores, v_stores);
  StepMap map = step_map(table, block_store, block_start, block_size, q_pos);
  const int32_t *st = store_of.data_ptr<int32_t>(), *sl = slot_of.data_ptr<int32_t>();
  return with_store_type(dtype, [&](auto element) {
    using T = decltype(element);
    FloatStores<T> stores{{k_stores}, {v_stores}, map, k_stores[0].size(0)};
    write_rows(stores.k, k, st, sl);
    write_rows(stores.v, v, st, sl);
    return run_attention(q, map, stores);
  });
}

// the windows hold residual + block_size rows (what the sequence keeps in full precision at most)
void check_ring(at::TensorList windows, const at::Tensor& upto, int64_t residual, int64_t sink,
                int64_t bs, int64_t batch) {
  TORCH_CHECK(upto.scalar_type() == at::kInt && upto.is_contiguous() && upto.numel() == batch, "upto: int32 [B]");
  TORCH_CHECK(residual >= 0 && residual % bs == 0 && sink >= 0, "residual: a multiple of the block size");
  for (const auto& w : windows)
    TORCH_CHECK(w.size(1) == sink + residual + bs, "windows: sink + residual + block_size rows");
}

inline int64_t quantized_end(int64_t upto, int64_t kv_len, int64_t residual, int64_t bs) {
  return std::max<int64_t>(upto, kv_len >= residual ? (kv_len - residual) / bs * bs : 0);
}

template <int BITS>
using KeyParam = std::conditional_t<BITS == 8, at::Half, uint8_t>;  // the element of a key parameter store

// whether this build keeps a quantized store's codes in tiles (see TILE_TOKENS): where the AVX-512 path reads both
// its keys and values, in blocks of a multiple of 16 tokens
bool kv_tiled([[maybe_unused]] int64_t bits, [[maybe_unused]] int64_t d, [[maybe_unused]] int64_t bs) {
#ifdef KVSCOPE_KV512
  return bs % TILE_TOKENS == 0 && kv512_keys(static_cast<int>(bits), d) && kv512_values(static_cast<int>(bits), d);
#else
  return false;
#endif
}

// kv_tiled for these codes, checking that a tiled store's rows are adjacent (a tile spans 16 of them)
bool tiled_stores(int64_t bits, int64_t d, int64_t bs, at::TensorList k_stores,
                  at::TensorList v_stores) {
  if (!kv_tiled(bits, d, bs)) return false;
  for (const auto* stores : {&k_stores, &v_stores})
    for (const auto& s : *stores)
      TORCH_CHECK(s.size(2) == d * bits / 8 && s.stride(1) == s.size(2), "tiled codes: adjacent rows of D * bits / 8");
  return true;
}

template <int BITS>
struct QuantStores {
  StoreAddresses<uint8_t> k, v;  // codes [Hkv, slots, D] int8 or [Hkv, slots, D/2] two int4 a byte
  StoreAddresses<KeyParam<BITS>> k_param;  // [Hkv, blocks, D] float16 (int8) / [Hkv, blocks, 2D + 4] bytes (int4)
  StoreAddresses<at::Half> v_param;  // [Hkv, slots] / [Hkv, slots, 2]
  StoreAddresses<WindowRow<BITS>> k_window, v_window;  // per sequence [Hkv, sink + ring, D]: sink rows, then the ring
  const StepMap& map;
  int64_t hkv;
  const int32_t* upto;
  int64_t residual, ring, sink;
  bool tiled;  // kv_tiled: codes in tiles
  int64_t num_kv_heads() const { return hkv; }
  // the rows of tile [k0, k1) of sequence b, head h; their address tables live in the thread's scratch until
  // its next call, which the rows carry to the tile's other buffers
  std::pair<QuantRows<BITS>, QuantRows<BITS>> operator()(int64_t b, int64_t h, int64_t k0, int64_t k1) const {
    QuantScratch<BITS>& scratch = QuantScratch<BITS>::of_this_thread();
    auto &k_code = scratch.k_code, &v_code = scratch.v_code;
    auto &k_prm = scratch.k_prm, &v_prm = scratch.v_prm;
    QuantRows<BITS> keys, values;
    keys.scratch = values.scratch = &scratch;
    int64_t end = map.kv_len(b), full = quantized_end(upto[b], end, residual, map.block_size), bs = map.block_size;
    keys.full = values.full = full;
    keys.end = values.end = end;
    keys.block_size = values.block_size = bs;
    keys.block_shift = values.block_shift = map.block_shift;
    keys.tiled = values.tiled = tiled;
    keys.ring = values.ring = ring;
    keys.sink = values.sink = sink;
    keys.sink_rows = k_window.at(b, h, 0);
    values.sink_rows = v_window.at(b, h, 0);
    keys.window = keys.sink_rows + sink * k_window.slot_stride[b];
    values.window = values.sink_rows + sink * v_window.slot_stride[b];
    keys.first = values.first = k0;
    int64_t quantized = std::max<int64_t>(0, std::min(k1, full) - k0);  // (positions below the sink unread)
    int64_t known = std::max<int64_t>(0, std::min(k1 + PREFETCH_AHEAD, full) - k0);  // and the next ones
    int64_t from = std::max(k0, std::min(sink, k0 + quantized)), to = k0 + known;
    int64_t first_block = map.blocks(from), blocks = from < to ? map.blocks(to - 1) + 1 - first_block : 0;
    v_code.resize(known), v_prm.resize(known), k_code.resize(blocks), k_prm.resize(blocks);
    keys.known = to;  // (the value tables cover the same positions; prefetch_codes reads both up to it)
    values.code = v_code.data(), values.param = v_prm.data();
    keys.block_code = k_code.data(), keys.block_param = k_prm.data();
    keys.first_block = first_block, keys.row_bytes = k.slot_stride.empty() ? 0 : k.slot_stride[0];
    // filled through plain pointers (the tables are the scratch's vectors)
    auto vcode = const_cast<const uint8_t**>(values.code);
    auto vprm = const_cast<const uint16_t**>(values.param);
    auto kcode = const_cast<const uint8_t**>(keys.block_code);
    auto kprm = const_cast<const uint16_t**>(keys.block_param);
    map.each_block(b, from, to, [&](int64_t p0, int64_t, int64_t store, int64_t slot) {
      int64_t blk = map.blocks(p0), start = slot - (p0 - blk * bs);  // the slot of the block's first position
      kcode[blk - first_block] = k.at(store, h, start);
      kprm[blk - first_block] = reinterpret_cast<const uint16_t*>(k_param.at(store, h, map.blocks(slot)));
    });
    map.each_run(b, from, to, [&](int64_t p0, int64_t p1, int64_t store, int64_t slot) {
      fill_addresses(v.at(store, h, slot), v.slot_stride[store], p1 - p0, vcode + (p0 - k0));
      fill_addresses(reinterpret_cast<const uint16_t*>(v_param.at(store, h, slot)), v_param.slot_stride[store],
                     p1 - p0, vprm + (p0 - k0));
    });
    return {keys, values};
  }
};

// a quantized cache's tensors: codes, scales and per-sequence windows of rows of D (int4: float16, int8: float32)
void check_quant_stores(int64_t bits, at::TensorList k_stores, at::TensorList v_stores,
                        at::TensorList k_params, at::TensorList v_params,
                        at::TensorList k_windows, at::TensorList v_windows) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(k_stores.size() == v_stores.size() && k_params.size() == k_stores.size() &&
                  v_params.size() == k_stores.size(), "codes and scales per store");
  auto codes = bits == 8 ? at::kChar : at::kByte;
  check_stores(k_stores, codes, 3, "key codes");
  for (const auto& s : k_stores)
    TORCH_CHECK(s.stride(1) == s.size(2), "key codes: adjacent rows of D * bits / 8 bytes");
  check_stores(v_stores, codes, 3, "value codes");
  check_stores(k_params, bits == 8 ? at::kHalf : at::kByte, 3, "key scales");
  check_stores(v_params, at::kHalf, bits == 8 ? 2 : 3, "value scales");
  auto rows = bits == 4 ? at::kHalf : at::kFloat;  // WindowRow
  check_stores(k_windows, rows, 3, "key windows");
  check_stores(v_windows, rows, 3, "value windows");
  TORCH_CHECK(k_windows.size() == v_windows.size(), "one value window per key window");
  for (const auto* windows : {&k_windows, &v_windows})
    for (const auto& w : *windows) TORCH_CHECK(w.stride(1) == w.size(2), "windows: contiguous rows of D");
  int64_t d = k_windows.empty() ? 0 : k_windows[0].size(2);
  if (bits == 4)
    for (const auto& p : k_params) TORCH_CHECK(p.size(2) == 2 * d + 4, "int4 key scales: [Hkv, blocks, 2D + 4] bytes");
}

inline float int8_scale(float absmax) {
  return static_cast<float>(c10::Half(std::max(absmax / 127.f, 1e-5f)));
}

inline uint8_t to_code(float x, float scale, float minimum, float top, float bottom) {
  return static_cast<uint8_t>(static_cast<int8_t>(std::min(top, std::max(bottom, std::nearbyint((x - minimum) / scale)))));
}

// n values x[0], x[stride], ... -> their float16 scale (int4: and minimum) in prm[0] (and prm[min_at]), and as floats
// in *scale (and *minimum: 0 for int8), what their codes are computed with
template <int BITS>
void group_params(const float* x, int64_t n, int64_t stride, uint16_t* prm, int64_t min_at, float* scale,
                  float* minimum) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) lo = std::min(lo, x[i * stride]), hi = std::max(hi, x[i * stride]);
  if constexpr (BITS == 8) {
    *scale = int8_scale(std::max(std::fabs(lo), std::fabs(hi)));
    *minimum = 0.f;
    prm[0] = c10::Half(*scale).x;
  } else {
    *minimum = static_cast<float>(c10::Half(lo));
    *scale = static_cast<float>(c10::Half(std::max((hi - *minimum) / 15.f, 1e-5f)));
    prm[0] = c10::Half(*scale).x;
    prm[min_at] = c10::Half(*minimum).x;
  }
}

// one row x[0..d) -> its codes to_code(x_j, scale_j, minimum_j) in `row` (int8: a byte each; int4: byte j holds
// channel j in its low nibble and j + d/2 in its high one). scale, minimum: per channel (step 1) or one for the row
// (step 0). The same operations as to_code, eight channels at a time where AVX2 is built (the same codes).
template <int BITS>
void put_row_codes(const float* x, const float* scale, const float* minimum, int64_t step, int64_t d, uint8_t* row) {
  constexpr float top = BITS == 8 ? 127.f : 15.f, bottom = BITS == 8 ? -127.f : 0.f;
  c10::SmallVector<int32_t, 256> codes(d);  // (in place up to a head of 256)
  int64_t j = 0;
#ifdef KVSCOPE_AVX2
  const __m256 vtop = _mm256_set1_ps(top), vbottom = _mm256_set1_ps(bottom);
  for (; j + 8 <= d; j += 8) {
    __m256 sc = step ? _mm256_loadu_ps(scale + j) : _mm256_set1_ps(*scale);
    __m256 mn = step ? _mm256_loadu_ps(minimum + j) : _mm256_set1_ps(*minimum);
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mn), sc),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, vbottom), vtop);  // (as std::min(top, std::max(bottom, q)): NaN -> bottom)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes.data() + j), _mm256_cvtps_epi32(q));
  }
#endif
  for (; j < d; ++j) codes[j] = static_cast<int8_t>(to_code(x[j], scale[j * step], minimum[j * step], top, bottom));
  if constexpr (BITS == 8) {
    for (j = 0; j < d; ++j) row[j] = static_cast<uint8_t>(static_cast<int8_t>(codes[j]));
  } else {
    for (j = 0; j < d / 2; ++j) row[j] = static_cast<uint8_t>(codes[j] | codes[j + d / 2] << 4);
  }
}

// the float16 value nearest x that is >= x (x >= 0), at least the smallest float16 (as quant._half_up)
inline float half_up(float x) {
  c10::Half h(x);
  if (static_cast<float>(h) < x) h.x = static_cast<uint16_t>(h.x + 1);
  return std::max(static_cast<float>(h), 5.9604645e-8f);
}

// int4 keys of a block [bs, D], per channel over its tokens, with two-level parameters (quant.quantize_keys_int4,
// the same operations in the same order): the minimum rounded down onto m_super's grid, then the scale up onto
// s_super's, so every value of the channel fits its 16 codes; prm: [D] scales, [D] minimums, the two supers
void quantize_keys_int4(const float* kwin, int64_t bs, int64_t d, uint8_t* const* k_rows, uint8_t* prm) {
  thread_local std::vector<float> lo, hi, need;
  lo.assign(kwin, kwin + d), hi.assign(kwin, kwin + d), need.resize(d);
  for (int64_t r = 1; r < bs; ++r)
    for (int64_t j = 0; j < d; ++j) lo[j] = std::min(lo[j], kwin[r * d + j]), hi[j] = std::max(hi[j], kwin[r * d + j]);
  float amax = 0.f, top = 0.f;
  for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(lo[j]));
  float m_super = half_up(amax / 127.f);
  for (int64_t j = 0; j < d; ++j) {
    float mc = std::min(127.f, std::max(-127.f, std::floor(lo[j] / m_super)));
    prm[d + j] = static_cast<uint8_t>(static_cast<int8_t>(mc));
    need[j] = (hi[j] - mc * m_super) / 15.f;
    top = std::max(top, need[j]);
  }
  float s_super = half_up(std::max(top, 1e-5f) / 255.f);
  c10::SmallVector<float, 256> scale(d), minimum(d);
  for (int64_t j = 0; j < d; ++j) {
    float sc = std::min(255.f, std::max(1.f, std::ceil(need[j] / s_super)));
    prm[j] = static_cast<uint8_t>(sc);
    scale[j] = sc * s_super, minimum[j] = static_cast<int8_t>(prm[d + j]) * m_super;
  }
  for (int64_t r = 0; r < bs; ++r) put_row_codes<4>(kwin + r * d, scale.data(), minimum.data(), 1, d, k_rows[r]);
  uint16_t supers[2] = {c10::Half(s_super).x, c10::Half(m_super).x};  // exact: both are float16 values
  std::memcpy(prm + 2 * d, supers, sizeof supers);
}

// a full block of window rows [bs, D] -> codes at slots first..first+bs-1 and their scales
template <int BITS>
void quantize_block(const float* kwin, const float* vwin, int64_t bs, int64_t d, uint8_t* const* k_rows,
                    uint8_t* const* v_rows, KeyParam<BITS>* k_prm, uint16_t* const* v_prm) {
  if constexpr (BITS == 4) {
    quantize_keys_int4(kwin, bs, d, k_rows, k_prm);
  } else {
    auto* prm = reinterpret_cast<uint16_t*>(k_prm);
    c10::SmallVector<float, 256> scale(d), zero(d);
    for (int64_t j = 0; j < d; ++j)  // keys: per channel over the block's tokens
      group_params<BITS>(kwin + j, bs, d, prm + j, d, &scale[j], &zero[j]);
    for (int64_t r = 0; r < bs; ++r) put_row_codes<BITS>(kwin + r * d, scale.data(), zero.data(), 1, d, k_rows[r]);
  }
  for (int64_t r = 0; r < bs; ++r) {  // values: per token
    float scale, minimum;
    group_params<BITS>(vwin + r * d, d, 1, v_prm[r], 1, &scale, &minimum);
    put_row_codes<BITS>(vwin + r * d, &scale, &minimum, 0, d, v_rows[r]);
  }
}

// writes of a quantized cache: each new token goes to its sequence's window (row p % W); when the
// sequence then has `residual` tokens after a block, that block is quantized into its store (see the head)
template <int BITS>
void write_quant(const QuantStores<BITS>& st, const at::Tensor& k, const at::Tensor& v) {
  const StepMap& map = st.map;
  const int32_t* upto = st.upto;
  const int64_t residual = st.residual, sink = st.sink, ring = st.ring;
  const bool tiled = st.tiled;
  const auto &kq = st.k, &vq = st.v, &kw = st.k_window, &vw = st.v_window;
  const auto &kp = st.k_param, &vp = st.v_param;
  int64_t b = k.size(0), h = k.size(1), t = k.size(2), d = k.size(3), bs = map.block_size;
  const float *kx = k.data_ptr<float>(), *vx = v.data_ptr<float>();
  thread_local std::vector<uint8_t*> k_rows, v_rows;  // (kept between calls: a layer's write is a call a step)
  thread_local std::vector<uint16_t*> v_prm;
  thread_local std::vector<float> k_block, v_block;
  thread_local std::vector<uint8_t> k_plain, v_plain;  // a tiled block's rows before they go to its tiles
  const int64_t w = d * BITS / 8;
  k_rows.resize(bs), v_rows.resize(bs), v_prm.resize(bs), k_block.resize(bs * d), v_block.resize(bs * d);
  k_plain.resize(tiled ? bs * w : 0), v_plain.resize(tiled ? bs * w : 0);
  uint8_t **kr = k_rows.data(), **vr = v_rows.data();  // (a thread_local's address is a call in a loop)
  uint16_t** vprm = v_prm.data();
  float *kb = k_block.data(), *vb = v_block.data();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti) {
      int64_t p = map.q_pos[bi * t + ti];
      if (p < 0) continue;
      int64_t exit = p + 1 - residual;  // positions before it may be quantized now
      int64_t first = exit - bs;  // the block that leaves the window with this token, if any
      bool quantize = exit >= bs && exit % bs == 0 && first >= upto[bi];
      int64_t blk = quantize ? map.table[bi * map.width + first / bs] : 0;
      int64_t store = map.block_store[blk], start = map.block_start[blk];
      for (int64_t hi = 0; hi < h; ++hi) {
        auto* kwin = const_cast<WindowRow<BITS>*>(kw.at(bi, hi, sink));
        auto* vwin = const_cast<WindowRow<BITS>*>(vw.at(bi, hi, sink));
        const float *krow = kx + ((bi * h + hi) * t + ti) * d, *vrow = vx + ((bi * h + hi) * t + ti) * d;
        put_row(krow, d, kwin + (p % ring) * d);
        put_row(vrow, d, vwin + (p % ring) * d);
        if (p < sink) {  // the sink's rows come first in the window tensor
          put_row(krow, d, const_cast<WindowRow<BITS>*>(kw.at(bi, hi, p)));
          put_row(vrow, d, const_cast<WindowRow<BITS>*>(vw.at(bi, hi, p)));
        }
        if (!quantize) continue;
        auto* k_dst = const_cast<uint8_t*>(kq.at(store, hi, start));
        auto* v_dst = const_cast<uint8_t*>(vq.at(store, hi, start));
        for (int64_t r = 0; r < bs; ++r) {
          row_to_floats(kwin + ((first + r) % ring) * d, d, kb + r * d);
          row_to_floats(vwin + ((first + r) % ring) * d, d, vb + r * d);
          kr[r] = tiled ? k_plain.data() + r * w : const_cast<uint8_t*>(kq.at(store, hi, start + r));
          vr[r] = tiled ? v_plain.data() + r * w : const_cast<uint8_t*>(vq.at(store, hi, start + r));
          vprm[r] = reinterpret_cast<uint16_t*>(const_cast<at::Half*>(vp.at(store, hi, start + r)));
        }
        auto* k_prm = const_cast<KeyParam<BITS>*>(kp.at(store, hi, start / bs));
        quantize_block<BITS>(kb, vb, bs, d, kr, vr, k_prm, vprm);
        if (tiled) to_tiles(k_plain.data(), bs, w, true, k_dst), to_tiles(v_plain.data(), bs, w, false, v_dst);
      }
    }
}

void check_quant_write(const at::Tensor& k, const at::Tensor& v, at::TensorList k_windows, const StepMap& map,
                       const at::Tensor& q_pos) {
  check_new_kv(k, v);
  TORCH_CHECK(static_cast<int64_t>(k_windows.size()) == k.size(0), "one window per sequence");
  TORCH_CHECK(k.size(3) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(map.t == k.size(2) && q_pos.size(0) == k.size(0), "q_pos: [B, T] for the new tokens");
}

void check_quant_attention(const at::Tensor& q, at::TensorList k_windows, int64_t block_size, int64_t bits) {
  TORCH_CHECK(k_windows.size() == static_cast<size_t>(q.size(0)), "one window per sequence");
  TORCH_CHECK(block_size >= 1 && block_size <= MAX_QUANT_BLOCK, "quantized KV: block_size from 1 to ",
              MAX_QUANT_BLOCK);
  TORCH_CHECK(q.size(3) % 16 == 0 && (bits == 8 || q.size(3) <= 256),
              "head_dim must be a multiple of 16 (int4: up to 256)");
}

// a quantized cache's stores, as its write and its attention read them (checked), for f(QuantStores<BITS>)
template <typename F>
decltype(auto) with_quant_stores(at::TensorList k_stores, at::TensorList v_stores, at::TensorList k_params,
                                 at::TensorList v_params, at::TensorList k_windows, at::TensorList v_windows,
                                 const StepMap& map, const at::Tensor& upto, int64_t residual, int64_t sink,
                                 int64_t bits, int64_t d, F f) {
  check_quant_stores(bits, k_stores, v_stores, k_params, v_params, k_windows, v_windows);
  check_ring(k_windows, upto, residual, sink, map.block_size, static_cast<int64_t>(k_windows.size()));
  bool tiled = tiled_stores(bits, d, map.block_size, k_stores, v_stores);
  int64_t hkv = k_stores[0].size(0), ring = k_windows[0].size(1) - sink;
  const int32_t* up = upto.data_ptr<int32_t>();
  if (bits == 8)
    return f(QuantStores<8>{{k_stores}, {v_stores}, {k_params}, {v_params}, {k_windows}, {v_windows}, map, hkv, up,
                            residual, ring, sink, tiled});
  return f(QuantStores<4>{{k_stores}, {v_stores}, {k_params}, {v_params}, {k_windows}, {v_windows}, map, hkv, up,
                          residual, ring, sink, tiled});
}

// k, v: the step's new keys and values [B, Hkv, T, D] float32 at the positions q_pos gives; upto: int32 [B]
void write_kv_quant(at::TensorList k_stores, at::TensorList v_stores,
                    at::TensorList k_params, at::TensorList v_params,
                    at::TensorList k_windows, at::TensorList v_windows, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& table, const at::Tensor& block_store,
                    const at::Tensor& block_start, int64_t block_size, const at::Tensor& q_pos, const at::Tensor& upto,
                    int64_t residual, int64_t sink, int64_t bits) {
  StepMap map = step_map(table, block_store, block_start, block_size, q_pos);
  check_quant_write(k, v, k_windows, map, q_pos);
  with_quant_stores(k_stores, v_stores, k_params, v_params, k_windows, v_windows, map, upto, residual, sink, bits,
                    k.size(3), [&](const auto& stores) { write_quant(stores, k, v); });
}

// a quantized cache: as `attention`, over codes and their scales, and per sequence a window holding its
// positions from the last full block on (the block being filled)
at::Tensor attention_quant(const at::Tensor& q, at::TensorList k_stores, at::TensorList v_stores,
                           at::TensorList k_params, at::TensorList v_params,
                           at::TensorList k_windows, at::TensorList v_windows,
                           const at::Tensor& table, const at::Tensor& block_store, const at::Tensor& block_start,
                           int64_t block_size, const at::Tensor& q_pos, const at::Tensor& upto, int64_t residual,
                           int64_t sink, int64_t bits) {
  check_quant_attention(q, k_windows, block_size, bits);
  StepMap map = step_map(table, block_store, block_start, block_size, q_pos);
  return with_quant_stores(k_stores, v_stores, k_params, v_params, k_windows, v_windows, map, upto, residual, sink,
                           bits, q.size(3), [&](const auto& stores) { return run_attention(q, map, stores); });
}

// write_kv_quant then attention_quant, the stores checked and their addresses found once for both
at::Tensor write_and_attend_quant(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  c10::ArrayRef<at::TensorList> g, at::TensorList where, c10::ArrayRef<int64_t> ints) {
  int64_t block_size = ints[0], residual = ints[1], sink = ints[2], bits = ints[3];
  StepMap map = step_map(where[0], where[1], where[2], block_size, where[3]);
  check_quant_write(k, v, g[4], map, where[3]);
  check_quant_attention(q, g[4], block_size, bits);
  return with_quant_stores(g[0], g[1], g[2], g[3], g[4], g[5], map, where[4], residual, sink, bits, q.size(3),
                           [&](const auto& stores) {
                             write_quant(stores, k, v);
                             return run_attention(q, map, stores);
                           });
}

// ---------------------------------------------------------------- one decoder layer of a decode step, in one call
// The same kernels as the per-op path, called in the same order on the same tensors (so the same bits), without
// a trip through Python and the dispatcher between them: a step of a small model makes ~10 such trips per layer.
// weights: the four projections' tensors in turn (qkv, o, gate_up, down), parts[i] of them each: 1 = float
// weights, 2 = int8 (codes, scales), 3 = int4 (codes, scales, minimums). norms: after attention, and the next
// layer's input norm. kv: the layer's stores, in groups of kv_parts[i] tensors (float caches: key stores, value
// stores; quantized caches: key codes, value codes, key params, value params, key windows, value windows);
// where: table, block_store, block_start, q_pos, then store_of and slot_of (float) or upto (quantized);
// ints: block_size, then residual, sink and bits (quantized).
at::Tensor project(const at::Tensor& x, at::TensorList w, size_t first, int64_t parts) {
  switch (parts) {
    case 1: return float_linear(x, w[first]);
    case 2: return int8_linear(x, w[first], w[first + 1]);
    case 3: return int4_linear(x, w[first], w[first + 1], w[first + 2]);
    default: TORCH_CHECK(false, "a projection has 1 (float), 2 (int8) or 3 (int4) tensors");
  }
}

c10::SmallVector<at::TensorList, 6> groups_of(at::TensorList flat, c10::ArrayRef<int64_t> parts) {
  c10::SmallVector<at::TensorList, 6> out;
  size_t at = 0;
  for (int64_t n : parts) {
    TORCH_CHECK(n >= 0 && at + n <= flat.size(), "kv_parts do not add up to the kv tensors");
    out.push_back(flat.slice(at, n));
    at += n;
  }
  TORCH_CHECK(at == flat.size(), "kv_parts do not add up to the kv tensors");
  return out;
}

at::Tensor attend_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList kv,
                        c10::ArrayRef<int64_t> kv_parts, at::TensorList where, c10::ArrayRef<int64_t> ints) {
  auto g = groups_of(kv, kv_parts);
  TORCH_CHECK((g.size() == 2 && where.size() == 6 && ints.size() == 1) ||
                  (g.size() == 6 && where.size() == 5 && ints.size() == 4),
              "kv: 2 groups (float) or 6 (quantized), with their where and ints");
  if (g.size() == 2) {
    return write_and_attend(q, k, v, g[0], g[1], where[0], where[1], where[2], ints[0], where[3], where[4], where[5]);
  }
  return write_and_attend_quant(q, k, v, g, where, ints);
}

// the model's rotary tables cos, sin: [B, 1, T, D] -> the [B, T, D] views rope_qkv reads
std::pair<at::Tensor, at::Tensor> rotary_rows(const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 4 && sin.dim() == 4, "cos, sin: [B, 1, T, D]");
  return {cos.select(1, 0), sin.select(1, 0)};
}

// decoder_layer with cos, sin as [B, T, D] (decoder_layers selects them once a step)
at::Tensor layer_of_step(at::Tensor& x, const at::Tensor& normed, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, c10::ArrayRef<int64_t> parts, at::TensorList norms, double eps,
                         int64_t hq, int64_t hkv, at::TensorList kv, c10::ArrayRef<int64_t> kv_parts,
                         at::TensorList where, c10::ArrayRef<int64_t> ints) {
  TORCH_CHECK(parts.size() == 4 && norms.size() == 2, "four projections (qkv, o, gate_up, down) and two norms");
  std::array<size_t, 4> first{};
  for (size_t i = 1; i < 4; ++i) first[i] = first[i - 1] + parts[i - 1];
  TORCH_CHECK(first[3] + parts[3] == weights.size(), "parts do not add up to the weight tensors");
  auto qkv = rope_qkv(project(normed, weights, first[0], parts[0]), cos, sin, hq, hkv);
  auto attended = attend_layer(qkv[0], qkv[1], qkv[2], kv, kv_parts, where, ints);  // [B, T, Hq * D]
  auto mid = add_rms_norm(x, project(attended, weights, first[1], parts[1]), norms[0], eps);
  auto gated = silu_mul(project(mid, weights, first[2], parts[2]));
  return add_rms_norm(x, project(gated, weights, first[3], parts[3]), norms[1], eps);
}

at::Tensor decoder_layer(at::Tensor x, const at::Tensor& normed, const at::Tensor& cos, const at::Tensor& sin,
                         std::vector<at::Tensor> weights, std::vector<int64_t> parts, std::vector<at::Tensor> norms,
                         double eps, int64_t hq, int64_t hkv, std::vector<at::Tensor> kv, std::vector<int64_t> kv_parts,
                         std::vector<at::Tensor> where, std::vector<int64_t> ints) {
  auto [cos3, sin3] = rotary_rows(cos, sin);
  return layer_of_step(x, normed, cos3, sin3, weights, parts, norms, eps, hq, hkv, kv, kv_parts, where, ints);
}

// the next n items of v from `at` (advanced), checked against v's end: a view of them, not a copy
template <typename T>
c10::ArrayRef<T> take_next(const std::vector<T>& v, size_t& at, int64_t n, const char* what) {
  TORCH_CHECK(n >= 0 && at + n <= v.size(), "decoder_layers: ", what, " runs short");
  c10::ArrayRef<T> part(v.data() + at, static_cast<size_t>(n));
  at += n;
  return part;
}

// Every layer of a decode step in one call: decoder_layer over the layers in order, each with its slice of the
// flattened lists (the same calls as one per layer, so the same bits; one dispatch and one argument conversion a
// step instead of one a layer). Per layer: 4 parts, 2 norms, an eps, 2 heads (query, KV) and 4 counts (its kv
// tensors, kv parts, where tensors and ints). Returns the last layer's output through the final norm.
at::Tensor decoder_layers(at::Tensor x, at::Tensor normed, const at::Tensor& cos, const at::Tensor& sin,
                          const std::vector<at::Tensor>& weights, const std::vector<int64_t>& parts,
                          const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                          const std::vector<int64_t>& heads, const std::vector<at::Tensor>& kv,
                          const std::vector<int64_t>& kv_parts, const std::vector<at::Tensor>& where,
                          const std::vector<int64_t>& ints, const std::vector<int64_t>& counts) {
  const size_t layers = eps.size();
  TORCH_CHECK(parts.size() == 4 * layers && norms.size() == 2 * layers && heads.size() == 2 * layers &&
                  counts.size() == 4 * layers,
              "decoder_layers: per layer 4 parts, 2 norms, an eps, 2 heads and 4 counts");
  const auto [cos3, sin3] = rotary_rows(cos, sin);
  size_t w = 0, n = 0, k = 0, kp = 0, wh = 0, in = 0, p = 0;
  ArenaScope arenas;
  for (size_t i = 0; i < layers; ++i) {
    arenas.layer(i);
    auto layer_parts = take_next(parts, p, 4, "parts");
    int64_t nw = layer_parts[0] + layer_parts[1] + layer_parts[2] + layer_parts[3];
    const int64_t* c = counts.data() + 4 * i;
    normed = layer_of_step(x, normed, cos3, sin3, take_next(weights, w, nw, "weights"), layer_parts,
                           take_next(norms, n, 2, "norms"), eps[i], heads[2 * i], heads[2 * i + 1],
                           take_next(kv, k, c[0], "kv"), take_next(kv_parts, kp, c[1], "kv_parts"),
                           take_next(where, wh, c[2], "where"), take_next(ints, in, c[3], "ints"));
  }
  TORCH_CHECK(w == weights.size() && k == kv.size() && kp == kv_parts.size() && wh == where.size() &&
                  in == ints.size(),
              "decoder_layers: more tensors than the layers' counts take");
  return normed;
}

// ---------------------------------------------------------------- sampling: the candidates top-k keeps
// A row of logits after the repetition penalty (CTRL's rule: a seen token's positive logit divided by the penalty,
// a negative one multiplied) and top-k, in one pass on the calling thread. torch's ops for the same (a clone, a
// gather and a scatter, topk, a comparison and a count over the vocabulary) took ~0.75 ms a token in the app, each
// op's code and data cold after a step (~0.25 ms on the same logits alone); this pass 77 us there, 20 alone.

// the bits of the SCAN_LANES logits at x above t (or_equal: at or above; NaN never is), lane i in bit i
#if defined(KVSCOPE_AVX512)
constexpr int64_t SCAN_LANES = 16;
inline uint32_t lanes_above(const float* x, float t, bool or_equal) {
  __m512 v = _mm512_loadu_ps(x), s = _mm512_set1_ps(t);
  return or_equal ? _mm512_cmp_ps_mask(v, s, _CMP_GE_OQ) : _mm512_cmp_ps_mask(v, s, _CMP_GT_OQ);
}
inline bool lanes_nan(const float* x) {
  __m512 v = _mm512_loadu_ps(x);
  return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
}
#elif defined(KVSCOPE_AVX2)
constexpr int64_t SCAN_LANES = 8;
inline uint32_t lanes_above(const float* x, float t, bool or_equal) {
  __m256 v = _mm256_loadu_ps(x), s = _mm256_set1_ps(t);
  return _mm256_movemask_ps(or_equal ? _mm256_cmp_ps(v, s, _CMP_GE_OQ) : _mm256_cmp_ps(v, s, _CMP_GT_OQ));
}
inline bool lanes_nan(const float* x) {
  __m256 v = _mm256_loadu_ps(x);
  return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
}
#else
constexpr int64_t SCAN_LANES = 1;
inline uint32_t lanes_above(const float* x, float t, bool or_equal) { return or_equal ? *x >= t : *x > t; }
inline bool lanes_nan(const float* x) { return std::isnan(*x); }
#endif

// f(i) for each i in [from, n) with x[i] above t (or_equal: at or above); t may rise between calls of f
template <typename F>
inline void each_above(const float* x, int64_t from, int64_t n, const float& t, bool or_equal, F f) {
  int64_t i = from;
  for (; i + SCAN_LANES <= n; i += SCAN_LANES)
    for (uint32_t bits = lanes_above(x + i, t, or_equal); bits; bits &= bits - 1) f(i + __builtin_ctz(bits));
  for (; i < n; ++i)
    if (or_equal ? x[i] >= t : x[i] > t) f(i);
}

bool any_nan(const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + SCAN_LANES <= n; i += SCAN_LANES)
    if (lanes_nan(x + i)) return true;
  for (; i < n; ++i)
    if (std::isnan(x[i])) return true;
  return false;
}

// logits with the penalty applied to the seen ids (each once, from its own logit: a repeated id changes nothing)
const float* penalized(const float* x, int64_t v, const at::Tensor& seen, double penalty) {
  if (penalty == 1.0 || seen.numel() == 0) return x;
  thread_local std::vector<float> out;
  out.assign(x, x + v);
  const float p = static_cast<float>(penalty);
  const at::Tensor ids = seen.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < v, "seen token id ", id[i], " is outside the vocabulary of ", v);
    out[id[i]] = x[id[i]] > 0 ? x[id[i]] / p : x[id[i]] * p;
  }
  return out.data();
}

// the k-th largest of x[0..v) (no NaN): the top of a min-heap of the k largest so far, only values above it let in
float kth_largest(const float* x, int64_t v, int64_t k) {
  std::vector<float> heap(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  float top = heap.front();
  each_above(x, k, v, top, false, [&](int64_t i) {
    if (!(x[i] > top)) return;  // (a lane compared before top rose)
    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
    heap.back() = x[i];
    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    top = heap.front();
  });
  return top;
}

// logits [V] float32, seen int64 [n] (the ids the penalty applies to) -> (values [m] float32, ids [m] int64): the k
// largest penalized logits and every one equal to the k-th (m >= k), largest first, equal ones by id; where a
// logit is NaN (the largest, as torch.topk and argmax take it), the NaNs alone, by id
std::vector<at::Tensor> top_candidates(const at::Tensor& logits, const at::Tensor& seen, double penalty, int64_t k) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "logits: contiguous float32 [V] on the CPU");
  TORCH_CHECK(seen.dim() == 1 && seen.scalar_type() == at::kLong && seen.device().is_cpu(), "seen: int64 [n]");
  const int64_t v = logits.numel();
  TORCH_CHECK(k >= 1 && k <= v, "top-k: k = ", k, " outside 1..", v);
  const float* x = penalized(logits.data_ptr<float>(), v, seen, penalty);
  std::vector<std::pair<float, int64_t>> kept;
  if (any_nan(x, v)) {
    for (int64_t i = 0; i < v; ++i)
      if (std::isnan(x[i])) kept.emplace_back(x[i], i);
  } else {
    const float kth = kth_largest(x, v, k);
    kept.reserve(k);
    each_above(x, 0, v, kth, true, [&](int64_t i) { kept.emplace_back(x[i], i); });  // (in id order)
    std::stable_sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  }
  const auto m = static_cast<int64_t>(kept.size());
  at::Tensor values = at::empty({m}, logits.options()), ids = at::empty({m}, logits.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) vp[i] = kept[i].first, ip[i] = kept[i].second;
  return {values, ids};
}

}  // namespace

// the weight rows an int4 projection's decode layout interleaves: 16 where the 16-row kernel is built, else 0
// (codes [N, K/2], rows one at a time)
int64_t int4_row_block() {
#if defined(KVSCOPE_AVX2)
  return ROW_BLOCK;
#else
  return 0;
#endif
}

TORCH_LIBRARY(kvscope, m) {
  m.def("int4_row_block() -> int", &int4_row_block);
  m.def("kv_tiled(int bits, int head_dim, int block_size) -> bool", &kv_tiled);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor minimums) -> Tensor", &int4_linear);
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor", &int8_linear);
  m.def("int8_embed(Tensor codes, Tensor scales, Tensor ids) -> Tensor", &int8_embed);
  m.def("float_linear(Tensor x, Tensor w) -> Tensor", &float_linear);
  m.def("top_candidates(Tensor logits, Tensor seen, float penalty, int k) -> Tensor[]", &top_candidates);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int hq, int hkv) -> Tensor[]", &rope_qkv);
  m.def("attention(Tensor q, Tensor[] k_stores, Tensor[] v_stores, Tensor table, Tensor block_store, "
        "Tensor block_start, int block_size, Tensor q_pos) -> Tensor", &attention);
  m.def("write_kv(Tensor(a!)[] k_stores, Tensor(b!)[] v_stores, Tensor k, Tensor v, Tensor store_of, "
        "Tensor slot_of) -> ()", &write_kv);
  m.def("write_kv_quant(Tensor(a!)[] k_stores, Tensor(b!)[] v_stores, Tensor(c!)[] k_params, Tensor(d!)[] v_params, "
        "Tensor(e!)[] k_windows, Tensor(f!)[] v_windows, Tensor k, Tensor v, Tensor table, Tensor block_store, "
        "Tensor block_start, int block_size, Tensor q_pos, Tensor upto, int residual, int sink, int bits) -> ()",
        &write_kv_quant);
  m.def("attention_quant(Tensor q, Tensor[] k_stores, Tensor[] v_stores, Tensor[] k_params, Tensor[] v_params, "
        "Tensor[] k_windows, Tensor[] v_windows, Tensor table, Tensor block_store, Tensor block_start, "
        "int block_size, Tensor q_pos, Tensor upto, int residual, int sink, int bits) -> Tensor", &attention_quant);
  m.def("decoder_layer(Tensor(a!) x, Tensor normed, Tensor cos, Tensor sin, Tensor[] weights, int[] parts, "
        "Tensor[] norms, float eps, int hq, int hkv, Tensor(b!)[] kv, int[] kv_parts, Tensor[] where, "
        "int[] ints) -> Tensor", &decoder_layer);
  m.def("decoder_layers(Tensor(a!) x, Tensor normed, Tensor cos, Tensor sin, Tensor[] weights, int[] parts, "
        "Tensor[] norms, float[] eps, int[] heads, Tensor(b!)[] kv, int[] kv_parts, Tensor[] where, int[] ints, "
        "int[] counts) -> Tensor", &decoder_layers);
}

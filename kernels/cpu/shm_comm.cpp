// ShmComm: the tensor-parallel collectives of ranks on one machine, through a shared
// memory segment instead of gloo's sockets.
//
// Why: a gloo all-reduce of one decode row costs ~2 ms on a 2-core VM (each op is a dozen
// thread hand-offs between the caller, gloo's worker and its socket loop), and a decode step
// runs two per layer: SmolLM2-sized at tp 2 took 158 ms a step where tp 1 takes 15
// (bench/RESULTS.md item 35). Here an op is a copy into this rank's slot, one atomic store,
// a wait for the other ranks' stores, and a read of their slots: microseconds while every
// rank is on a core. SGLang's CPU backend and vLLM's CPU communicator take the same route.
//
// Segment layout (runtime/distributed/shm_comm.py creates and maps it, zero-filled):
//   Header, then for each rank two data slots of slot_bytes (op k uses slot k % 2).
// Invariants:
//   - Every rank runs the same sequence of ops (the process group's rule for collectives);
//     op k of every rank is the same collective on same-shaped tensors.
//   - A rank stores arrived = k only after its slot holds its op-k data (release), and reads
//     other slots only after seeing their arrived >= k (acquire).
//   - Every op waits until all ranks arrived at it. So a rank entering op k + 2 (which
//     overwrites slot k % 2) knows every rank arrived at op k + 1, i.e. finished reading op k.
//   - Sums run over the ranks in rank order in float32: every rank gets the same bits.
// Waiting: spin for spin_us, then sleep on a futex in the segment (an arrival wakes the
// sleepers), re-checking every 20 ms whether a peer process has died (its /proc entry gone,
// a zombie, or a new process with its pid) and whether the op's timeout has passed: either
// raises, as gloo's collective does when a peer dies or hangs.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"

namespace {

using Clock = std::chrono::steady_clock;

static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint64_t>::is_always_lock_free);

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Whether the process (pid, start time in clock ticks since boot, /proc/PID/stat field 22)
// still runs. A zombie has exited; a different start time is a new process with that pid.
bool alive(int64_t pid, int64_t start_time) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return false;
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return false;
  std::istringstream rest(stat.substr(close + 2));
  std::string field, state;
  rest >> state;
  for (int i = 4; i <= 22 && rest >> field; ++i) {
  }
  return state != "Z" && state != "X" && field == std::to_string(start_time);
}

}  // namespace

struct alignas(64) ShmComm::RankState {
  std::atomic<uint64_t> arrived;  // the last op this rank entered, its slot written
};

struct alignas(64) ShmComm::Header {
  std::atomic<uint32_t> wake;      // futex word: bumped by an arrival while someone sleeps
  std::atomic<uint32_t> sleepers;  // ranks inside the futex wait
};

ShmComm::ShmComm(at::Tensor segment, int64_t rank, int64_t world, int64_t slot_bytes, std::vector<int64_t> pids,
                 std::vector<int64_t> start_times, double spin_us)
    : segment_(std::move(segment)),
      rank_(rank),
      world_(world),
      slot_bytes_(slot_bytes),
      pids_(std::move(pids)),
      start_times_(std::move(start_times)),
      spin_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(spin_us))) {
  TORCH_CHECK(segment_.is_contiguous() && segment_.scalar_type() == at::kByte, "segment: contiguous uint8");
  TORCH_CHECK(world_ >= 1 && 0 <= rank_ && rank_ < world_, "rank ", rank_, " of ", world_);
  TORCH_CHECK(slot_bytes_ > 0 && slot_bytes_ % 64 == 0, "slot_bytes: a positive multiple of 64");
  TORCH_CHECK(static_cast<int64_t>(pids_.size()) == world_ && static_cast<int64_t>(start_times_.size()) == world_,
              "one pid and start time per rank");
  TORCH_CHECK(segment_.numel() >= segment_bytes(world_, slot_bytes_), "segment too small");
  auto* base = segment_.data_ptr<uint8_t>();
  header_ = reinterpret_cast<Header*>(base);
  ranks_ = reinterpret_cast<RankState*>(base + sizeof(Header));
  data_ = base + sizeof(Header) + world_ * sizeof(RankState);
  op_ = ranks_[rank_].arrived.load();  // 0 in a fresh segment
}

int64_t ShmComm::segment_bytes(int64_t world, int64_t slot_bytes) {
  return sizeof(Header) + world * sizeof(RankState) + world * 2 * slot_bytes;
}

uint8_t* ShmComm::slot(int64_t rank, uint64_t op) const {
  return data_ + (rank * 2 + static_cast<int64_t>(op % 2)) * slot_bytes_;
}

void ShmComm::arrive(uint64_t op) {
  // seq_cst store, then the sleepers load: with the waiter's seq_cst increment before its
  // last check, either it sees this arrival or this sees it asleep and wakes it.
  ranks_[rank_].arrived.store(op, std::memory_order_seq_cst);
  if (header_->sleepers.load(std::memory_order_seq_cst) > 0) {
    header_->wake.fetch_add(1, std::memory_order_seq_cst);
    futex(&header_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

bool ShmComm::all_arrived(uint64_t op) const {
  for (int64_t r = 0; r < world_; ++r)
    if (ranks_[r].arrived.load(std::memory_order_acquire) < op) return false;
  return true;
}

void ShmComm::wait_all(uint64_t op, double timeout_s) const {
  const auto start = Clock::now();
  for (int i = 0; !all_arrived(op); ++i) {
    _mm_pause();
    if (i % 64 == 63 && Clock::now() - start > spin_) break;
  }
  const timespec tick{0, 20'000'000};
  while (!all_arrived(op)) {
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = header_->wake.load(std::memory_order_seq_cst);
    if (!all_arrived(op)) futex(&header_->wake, FUTEX_WAIT, seen, &tick);
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (all_arrived(op)) return;
    for (int64_t r = 0; r < world_; ++r) {
      if (r != rank_ && ranks_[r].arrived.load() < op && !alive(pids_[r], start_times_[r]))
        throw std::runtime_error("shm collective: tensor-parallel rank " + std::to_string(r) + " (pid " +
                                 std::to_string(pids_[r]) + ") has exited");
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (timeout_s > 0 && waited > timeout_s) {
      std::string late;
      for (int64_t r = 0; r < world_; ++r)
        if (ranks_[r].arrived.load() < op) late += (late.empty() ? "" : ", ") + std::to_string(r);
      throw std::runtime_error("shm collective: timed out after " + std::to_string(timeout_s) +
                               " s waiting for tensor-parallel rank(s) " + late);
    }
  }
}

namespace {

template <typename T>
void sum_slots(T* out, const std::vector<const T*>& parts, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float s = static_cast<float>(parts[0][i]);
    for (size_t r = 1; r < parts.size(); ++r) s += static_cast<float>(parts[r][i]);
    out[i] = static_cast<T>(s);
  }
}

}  // namespace

void ShmComm::all_reduce_(at::Tensor x, double timeout_s) {
  RECORD_FUNCTION("shm:all_reduce", std::vector<c10::IValue>());  // torch.profiler's name, as gloo's "gloo:all_reduce"
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "all_reduce_: a contiguous CPU tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "all_reduce_: float32/16 only");
  std::lock_guard<std::mutex> one_op(mu_);
  const int64_t elem = x.element_size(), per_op = slot_bytes_ / elem;
  auto* bytes = static_cast<uint8_t*>(x.data_ptr());
  for (int64_t done = 0; done < x.numel(); done += per_op) {  // a tensor past a slot: one op per slot-full
    const int64_t n = std::min(per_op, x.numel() - done);
    const uint64_t op = ++op_;
    std::memcpy(slot(rank_, op), bytes + done * elem, n * elem);
    arrive(op);
    wait_all(op, timeout_s);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "shm_all_reduce", [&] {
      std::vector<const scalar_t*> parts;
      for (int64_t r = 0; r < world_; ++r) parts.push_back(reinterpret_cast<const scalar_t*>(slot(r, op)));
      sum_slots(reinterpret_cast<scalar_t*>(bytes) + done, parts, n);
    });
  }
}

at::Tensor ShmComm::all_gather(at::Tensor x, double timeout_s) {
  RECORD_FUNCTION("shm:all_gather", std::vector<c10::IValue>());
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "all_gather: a contiguous CPU tensor");
  std::vector<int64_t> shape{world_};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, x.options());
  std::lock_guard<std::mutex> one_op(mu_);
  const int64_t total = x.nbytes();
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t done = 0; done < total; done += slot_bytes_) {
    const int64_t n = std::min(slot_bytes_, total - done);
    const uint64_t op = ++op_;
    std::memcpy(slot(rank_, op), src + done, n);
    arrive(op);
    wait_all(op, timeout_s);
    for (int64_t r = 0; r < world_; ++r) std::memcpy(dst + r * total + done, slot(r, op), n);
  }
  return out;
}

void ShmComm::broadcast_(at::Tensor x, int64_t root, double timeout_s) {
  RECORD_FUNCTION("shm:broadcast", std::vector<c10::IValue>());
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "broadcast_: a contiguous CPU tensor");
  TORCH_CHECK(0 <= root && root < world_, "broadcast_: root ", root);
  std::lock_guard<std::mutex> one_op(mu_);
  const int64_t total = x.nbytes();
  auto* bytes = static_cast<uint8_t*>(x.data_ptr());
  for (int64_t done = 0; done < total; done += slot_bytes_) {
    const int64_t n = std::min(slot_bytes_, total - done);
    const uint64_t op = ++op_;
    if (rank_ == root) std::memcpy(slot(rank_, op), bytes + done, n);
    arrive(op);
    wait_all(op, timeout_s);
    if (rank_ != root) std::memcpy(bytes + done, slot(root, op), n);
  }
}

// Cooperative execution of one Metal compute dispatch on a CPU.
//
// One threadgroup runs at a time. Each Metal thread is a fiber with its own stack;
// a fiber runs until it reaches a synchronising call (threadgroup_barrier or a
// simd_* function) or returns, then control comes back to the scheduler here.
// - A barrier releases when every live (not yet returned) thread of the group
//   waits at it; threads waiting at different barrier call sites are an error.
// - A simdgroup function releases when every live lane of the simdgroup waits at
//   the same call site; lanes blocked elsewhere with nobody runnable is a deadlock,
//   reported with each thread's position and source line.
// - The order in which runnable fibers run between synchronisation points follows
//   a schedule (serial, reversed, random), so a missing barrier shows up as a
//   result that changes with the schedule or reads NaN-filled threadgroup memory.
//
// The host side (worker.py) allocates buffers with msl_alloc: each sits against a
// PROT_NONE guard page and is surrounded by canary bytes, and a SIGSEGV handler
// names the buffer an out-of-bounds access hit.
#include <algorithm>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include "msl_abi.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

typedef void (*msl_invoke_fn)(void** buffers, const msl_thread_attrs* attrs);

// Defined by the generated source of each kernel: calls the kernel with the
// buffers and this thread's attribute values.
extern "C" void msl_kernel_invoke(void** buffers, const msl_thread_attrs* attrs);

namespace {

// ---------------------------------------------------------------- fibers
#if defined(__x86_64__)
// Saves callee-saved registers, MXCSR and the x87 control word on the current
// stack, stores the stack pointer in *from and resumes the context at `to`.
extern "C" void msl_ctx_switch(void** from, void* to);
asm(R"(
.text
.globl msl_ctx_switch
.type msl_ctx_switch,@function
msl_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size msl_ctx_switch,.-msl_ctx_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#endif

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

struct Fiber {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  char* stack = nullptr;  // lowest usable address (a guard page sits below it)
  State state = DONE;
  msl_site site{nullptr, 0, 0, 0};  // where it waits, or last waited
  msl_thread_attrs attrs{};
  int linear = 0;
  alignas(16) unsigned char slot[MSL_SIMD_SLOT];
};

constexpr size_t kStackSize = 256 * 1024;
constexpr int kMaxThreads = 1024;
constexpr size_t kMaxThreadgroupBytes = 32 * 1024;

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<char*> stack_maps;
  Fiber* current = nullptr;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  void** buffers = nullptr;
  std::string error;
  bool failed = false;
  unsigned long epoch = 0;
  // Per simdgroup snapshot of the lanes' deposits, taken when the call releases.
  std::vector<unsigned char> snapshots;  // [num_simdgroups][32][16]
  std::vector<uint32_t> active_masks;
  struct TgVar {
    void* p;
    size_t bytes;
    unsigned long epoch;
  };
  std::vector<TgVar> tg_vars;
  size_t tg_bytes_this_group = 0;
  int group_linear = 0;
  // Cost counters of the current launch (see msl_last_counts).
  uint64_t simd_ops = 0;             // simd_* calls, once per simdgroup per call
  uint64_t simdgroup_barriers = 0;   // simdgroup_barrier calls, once per simdgroup
  uint64_t threadgroup_barriers = 0; // threadgroup_barrier releases, once per group
  uint64_t device_bytes_read = 0;    // loads from kernel buffers (counting builds)
  uint64_t device_bytes_written = 0; // stores to kernel buffers (counting builds)
};

Runtime R;

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string site_str(const msl_site& s) {
  if (!s.file) return "<no call site>";
  static const char* names[] = {"?", "threadgroup_barrier", "simdgroup_barrier", "simd_sum",
                                "simd_product", "simd_max", "simd_min", "simd_and", "simd_or",
                                "simd_xor", "simd_prefix_inclusive_sum",
                                "simd_prefix_exclusive_sum", "simd_broadcast",
                                "simd_broadcast_first", "simd_shuffle", "simd_shuffle_xor",
                                "simd_shuffle_up", "simd_shuffle_down", "simd_all", "simd_any",
                                "simd_is_first", "simdgroup_load", "simdgroup_store",
                                "simdgroup_multiply_accumulate", "simdgroup_multiply"};
  const char* n = (s.op > 0 && s.op <= msl_op_simdgroup_multiply) ? names[s.op] : "?";
  return fmt("%s at %s:%d:%d", n, s.file, s.line, s.column);
}

std::string thread_str(const Fiber& f) {
  const auto& a = f.attrs;
  return fmt("thread %u (simdgroup %u lane %u) of threadgroup (%u,%u,%u)",
             a.thread_index_in_threadgroup, a.simdgroup_index_in_threadgroup,
             a.thread_index_in_simdgroup, a.threadgroup_position_in_grid.x,
             a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z);
}

bool same_site(const msl_site& a, const msl_site& b) {
  return a.op == b.op && a.line == b.line && a.column == b.column &&
         (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

void yield_to_scheduler() {
#if defined(__x86_64__)
  msl_ctx_switch(&R.current->sp, R.sched_sp);
#else
  swapcontext(&R.current->uc, &R.sched_uc);
#endif
}

void fiber_main() {
  Fiber* f = R.current;
  msl_kernel_invoke(R.buffers, &f->attrs);
  f->state = DONE;
  yield_to_scheduler();
  __builtin_trap();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
void fiber_entry_uc() { fiber_main(); }
#endif

void ensure_stacks(int n) {
  while ((int)R.stack_maps.size() < n) {
    size_t page = sysconf(_SC_PAGESIZE);
    char* m = (char*)mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "msl runtime: cannot map a fiber stack\n");
      std::_Exit(5);
    }
    mprotect(m, page, PROT_NONE);  // stack overflow becomes a SIGSEGV we can report
    R.stack_maps.push_back(m);
  }
}

void start_fiber(Fiber& f, int i) {
  size_t page = sysconf(_SC_PAGESIZE);
  f.stack = R.stack_maps[i] + page;
#if defined(__x86_64__)
  // Initial frame that msl_ctx_switch "returns" into: fake saved registers, the
  // current MXCSR/x87 control words, then the entry point and a null return address.
  uintptr_t top = ((uintptr_t)(f.stack + kStackSize)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)top;
  *--sp = 0;                                  // return address of fiber_main: never used
  *--sp = (uint64_t)(uintptr_t)&fiber_main;  // popped by `ret`
  for (int k = 0; k < 6; ++k) *--sp = 0;      // rbp rbx r12 r13 r14 r15
  uint32_t ctl[2];
  asm volatile("stmxcsr %0" : "=m"(ctl[0]));
  asm volatile("fnstcw %0" : "=m"(ctl[1]));
  --sp;
  std::memcpy(sp, ctl, 8);
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kStackSize;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, fiber_entry_uc, 0);
#endif
  f.state = RUNNABLE;
}

void resume(Fiber& f) {
  R.current = &f;
#if defined(__x86_64__)
  msl_ctx_switch(&R.sched_sp, f.sp);
#else
  swapcontext(&R.sched_uc, &f.uc);
#endif
  R.current = nullptr;
}

void uint3_set(msl_uint3& v, unsigned x, unsigned y, unsigned z) {
  v.x = x;
  v.y = y;
  v.z = z;
}

void fail_now(const std::string& msg) {
  if (!R.failed) {
    R.failed = true;
    R.error = msg;
  }
}

// Runs the group whose fibers are set up; returns false on error (R.error set).
bool run_group(int schedule, std::mt19937_64& rng) {
  const int n = (int)R.fibers.size();
  const int nsg = (n + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH;
  std::vector<int> order(n);
  for (;;) {
    for (int i = 0; i < n; ++i) order[i] = schedule == 1 ? n - 1 - i : i;
    if (schedule == 2) std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      Fiber& f = R.fibers[i];
      if (f.state != RUNNABLE) continue;
      resume(f);
      if (R.failed) return false;
    }
    bool all_done = true;
    for (auto& f : R.fibers) all_done &= f.state == DONE;
    if (all_done) return true;

    // Simdgroups whose live lanes all wait at a simdgroup call may proceed. Serial
    // releases all of them (lockstep); reversed releases only the last one and random a
    // random one, so one simdgroup runs ahead of the others as far as it can (a missing
    // threadgroup_barrier between simdgroups then shows as a schedule difference).
    std::vector<int> ready;
    for (int g = 0; g < nsg; ++g) {
      int lo = g * MSL_SIMD_WIDTH, hi = std::min(n, lo + MSL_SIMD_WIDTH);
      bool any_live = false, all_simd = true;
      for (int i = lo; i < hi; ++i) {
        if (R.fibers[i].state == DONE) continue;
        any_live = true;
        all_simd &= R.fibers[i].state == AT_SIMD;
      }
      if (any_live && all_simd) ready.push_back(g);
    }
    if (schedule == 1 && ready.size() > 1) ready.erase(ready.begin(), ready.end() - 1);
    if (schedule == 2 && ready.size() > 1) {
      int keep = ready[rng() % ready.size()];
      ready.assign(1, keep);
    }
    bool released = false;
    for (int g : ready) {
      int lo = g * MSL_SIMD_WIDTH, hi = std::min(n, lo + MSL_SIMD_WIDTH);
      bool any_live = false, all_simd = true;
      for (int i = lo; i < hi; ++i) {
        if (R.fibers[i].state == DONE) continue;
        any_live = true;
        all_simd &= R.fibers[i].state == AT_SIMD;
      }
      if (!any_live || !all_simd) continue;
      const Fiber* first = nullptr;
      for (int i = lo; i < hi; ++i) {
        const Fiber& f = R.fibers[i];
        if (f.state == DONE) continue;
        if (!first) {
          first = &f;
        } else if (!same_site(first->site, f.site)) {
          fail_now(fmt("deadlock: the live lanes of simdgroup %d wait at different simdgroup "
                       "calls: %s waits at %s, %s waits at %s",
                       g, thread_str(*first).c_str(), site_str(first->site).c_str(),
                       thread_str(f).c_str(), site_str(f.site).c_str()));
          return false;
        }
      }
      uint32_t mask = 0;
      unsigned char* snap = &R.snapshots[(size_t)g * MSL_SIMD_WIDTH * MSL_SIMD_SLOT];
      for (int i = lo; i < hi; ++i) {
        Fiber& f = R.fibers[i];
        if (f.state == DONE) continue;
        mask |= 1u << (i - lo);
        std::memcpy(snap + (i - lo) * MSL_SIMD_SLOT, f.slot, MSL_SIMD_SLOT);
        f.state = RUNNABLE;
      }
      R.active_masks[g] = mask;
      if (first->site.op == msl_op_simd_barrier)
        R.simdgroup_barriers++;
      else
        R.simd_ops++;
      released = true;
    }
    if (released) continue;

    // No simdgroup call can release: either every live thread is at one barrier...
    const Fiber* at_barrier = nullptr;
    bool all_barrier = true;
    for (auto& f : R.fibers) {
      if (f.state == DONE) continue;
      if (f.state != AT_BARRIER) {
        all_barrier = false;
        break;
      }
      if (!at_barrier) {
        at_barrier = &f;
      } else if (!same_site(at_barrier->site, f.site)) {
        fail_now(fmt("deadlock: threads wait at different threadgroup barriers: %s at %s, %s at %s",
                     thread_str(*at_barrier).c_str(), site_str(at_barrier->site).c_str(),
                     thread_str(f).c_str(), site_str(f.site).c_str()));
        return false;
      }
    }
    if (all_barrier && at_barrier) {
      int returned = 0;
      for (auto& f : R.fibers) returned += f.state == DONE;
      if (returned) {
        // Metal requires every thread of the group to execute each barrier.
        fail_now(fmt("%s is reached by %d threads while %d threads of the group have already "
                     "returned (every thread must execute each threadgroup_barrier)",
                     site_str(at_barrier->site).c_str(), n - returned, returned));
        return false;
      }
      for (auto& f : R.fibers)
        if (f.state == AT_BARRIER) f.state = RUNNABLE;
      R.threadgroup_barriers++;
      continue;
    }
    // ... or nothing can ever move again.
    std::string msg = "deadlock: no thread can proceed;";
    int shown = 0;
    for (auto& f : R.fibers) {
      if (f.state == DONE) continue;
      if (shown++ == 6) {
        msg += " ...";
        break;
      }
      msg += " " + thread_str(f) + " waits at " + site_str(f.site) + ";";
    }
    int done = 0;
    for (auto& f : R.fibers) done += f.state == DONE;
    msg += fmt(" %d of %d threads have returned", done, n);
    fail_now(msg);
    return false;
  }
}

// ------------------------------------------------------------ guarded buffers
struct Buffer {
  char* map;
  size_t map_len;
  char* data;
  size_t bytes;
  char name[64];
  std::vector<unsigned char>* writes;  // per-byte store count (write-set check), or null
};
std::vector<Buffer> g_buffers;
constexpr unsigned char kCanary = 0xA5;

void describe_fault(void* addr, char* out, size_t n) {
  uintptr_t a = (uintptr_t)addr;
  for (auto& b : g_buffers) {
    uintptr_t lo = (uintptr_t)b.map, hi = lo + b.map_len;
    if (a < lo || a >= hi) continue;
    uintptr_t d0 = (uintptr_t)b.data, d1 = d0 + b.bytes;
    if (a >= d1)
      snprintf(out, n, "%zu bytes past the end of buffer '%s' (%zu bytes)", (size_t)(a - d1),
               b.name, b.bytes);
    else if (a < d0)
      snprintf(out, n, "%zu bytes before the start of buffer '%s'", (size_t)(d0 - a), b.name);
    else
      snprintf(out, n, "inside buffer '%s' at byte %zu (a write to a read-only input?)", b.name,
               (size_t)(a - d0));
    return;
  }
  for (size_t i = 0; i < R.stack_maps.size(); ++i) {
    uintptr_t lo = (uintptr_t)R.stack_maps[i];
    if (a >= lo && a < lo + sysconf(_SC_PAGESIZE)) {
      snprintf(out, n, "fiber stack overflow of thread %zu", i);
      return;
    }
  }
  snprintf(out, n, "not in any kernel buffer");
}

void on_signal(int sig, siginfo_t* info, void* uctx) {
  char where[256];
  describe_fault(info->si_addr, where, sizeof where);
  char thr[256] = "outside any Metal thread";
  if (R.current) {
    std::string t = thread_str(*R.current);
    snprintf(thr, sizeof thr, "%s (last synchronised at %s)", t.c_str(),
             site_str(R.current->site).c_str());
  }
  char pc_info[512] = "";
#if defined(__x86_64__)
  void* pc = (void*)((ucontext_t*)uctx)->uc_mcontext.gregs[REG_RIP];
  Dl_info dl;
  if (dladdr(pc, &dl) && dl.dli_fname)
    snprintf(pc_info, sizeof pc_info, "\nMSL_FAULT_PC %s 0x%lx", dl.dli_fname,
             (unsigned long)((char*)pc - (char*)dl.dli_fbase));
#else
  (void)uctx;
#endif
  char msg[1400];
  int len = snprintf(msg, sizeof msg,
                     "MSL_FAULT %s at address %p: %s; in %s%s\n",
                     sig == SIGSEGV  ? "SIGSEGV"
                     : sig == SIGBUS ? "SIGBUS"
                     : sig == SIGFPE ? "SIGFPE"
                     : sig == SIGILL ? "SIGILL (a trap: undefined behaviour in a ubsan build?)"
                                     : "signal",
                     info->si_addr, where, thr, pc_info);
  if (len > 0) {
    ssize_t w = write(2, msg, (size_t)std::min(len, (int)sizeof msg - 1));
    (void)w;
  }
  _exit(70 + sig);
}

}  // namespace

extern "C" {

// libgcc 12 lacks the float -> bfloat16 conversion clang calls; round to nearest even.
__bf16 __truncsfbf2(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t r;
  if ((u & 0x7fffffffu) > 0x7f800000u)
    r = (uint16_t)((u >> 16) | 0x40);  // keep NaN a (quiet) NaN
  else
    r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  __bf16 b;
  std::memcpy(&b, &r, 2);
  return b;
}
__bf16 __truncdfbf2(double d) { return __truncsfbf2((float)d); }

// Called by the inline simd functions of msl_compat.h.
const unsigned char* msl_rt_simd_sync(const void* value, int size, msl_site site, uint32_t* active,
                                      int* lane) {
  Fiber* f = R.current;
  std::memset(f->slot, 0, MSL_SIMD_SLOT);
  std::memcpy(f->slot, value, (size_t)size);
  f->site = site;
  f->state = AT_SIMD;
  yield_to_scheduler();
  int sg = f->linear / MSL_SIMD_WIDTH;
  *active = R.active_masks[sg];
  *lane = f->linear % MSL_SIMD_WIDTH;
  return &R.snapshots[(size_t)sg * MSL_SIMD_WIDTH * MSL_SIMD_SLOT];
}

int msl_rt_lane(void) { return R.current ? R.current->linear % MSL_SIMD_WIDTH : 0; }

void msl_rt_barrier(msl_site site) {
  Fiber* f = R.current;
  f->site = site;
  f->state = AT_BARRIER;
  yield_to_scheduler();
}

void msl_rt_tg_register(void* p, size_t bytes, const char* file, int line) {
  for (auto& v : R.tg_vars) {
    if (v.p != p) continue;
    if (v.epoch != R.epoch) {
      v.epoch = R.epoch;
      std::memset(p, 0xFF, bytes);
      R.tg_bytes_this_group += bytes;
    }
    goto check;
  }
  R.tg_vars.push_back({p, bytes, R.epoch});
  std::memset(p, 0xFF, bytes);
  R.tg_bytes_this_group += bytes;
check:
  if (R.tg_bytes_this_group > kMaxThreadgroupBytes) {
    msl_site s{file, line, 0, 0};
    msl_rt_fail(fmt("threadgroup memory of %zu bytes exceeds the 32 KiB Metal allows",
                    R.tg_bytes_this_group)
                    .c_str(),
                s);
  }
}

void msl_rt_fail(const char* msg, msl_site site) {
  std::string where = site.file ? fmt("%s:%d:%d", site.file, site.line, site.column) : "?";
  std::string who = R.current ? thread_str(*R.current) : "no thread";
  fail_now(fmt("%s (at %s, %s)", msg, where.c_str(), who.c_str()));
  if (R.current) {
    R.current->state = DONE;
    yield_to_scheduler();
  }
  std::fprintf(stderr, "%s\n", R.error.c_str());
  std::_Exit(6);
}

void msl_install_handlers(void) {
  static char altstack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGFPE, &sa, nullptr);
  sigaction(SIGILL, &sa, nullptr);
}

// A buffer of `bytes` bytes whose end abuts a PROT_NONE page and whose slack
// (start alignment of 16) holds canary bytes.
void* msl_alloc(size_t bytes, const char* name) {
  size_t page = sysconf(_SC_PAGESIZE);
  size_t padded = (bytes + 15) & ~(size_t)15;
  size_t data_pages = (padded + page - 1) / page;
  if (data_pages == 0) data_pages = 1;
  size_t len = (data_pages + 2) * page;
  char* m = (char*)mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, page, PROT_NONE);
  mprotect(m + (data_pages + 1) * page, page, PROT_NONE);
  char* end = m + (data_pages + 1) * page;
  char* data = end - padded;
  std::memset(m + page, kCanary, data_pages * page);
  Buffer b{m, len, data, bytes, {0}, nullptr};
  snprintf(b.name, sizeof b.name, "%s", name);
  g_buffers.push_back(b);
  return data;
}

// A buffer of `bytes` bytes mapped with MAP_NORESERVE and never touched here: pages
// cost memory only once written, so a pool of many GiB can hold a few live blocks.
// Guard pages sit on both sides; only the slack before the data holds canaries.
void* msl_alloc_sparse(size_t bytes, const char* name) {
  size_t page = sysconf(_SC_PAGESIZE);
  size_t padded = (bytes + 15) & ~(size_t)15;
  size_t data_pages = (padded + page - 1) / page;
  if (data_pages == 0) data_pages = 1;
  size_t len = (data_pages + 2) * page;
  char* m = (char*)mmap(nullptr, len, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, page, PROT_NONE);
  mprotect(m + (data_pages + 1) * page, page, PROT_NONE);
  char* end = m + (data_pages + 1) * page;
  char* data = end - padded;
  std::memset(m + page, kCanary, (size_t)(data - (m + page)));
  std::memset(data + bytes, kCanary, padded - bytes);
  Buffer b{m, len, data, bytes, {0}, nullptr};
  snprintf(b.name, sizeof b.name, "%s", name);
  g_buffers.push_back(b);
  return data;
}

static Buffer* find_buffer(void* p) {
  for (auto& b : g_buffers)
    if (b.data == p) return &b;
  return nullptr;
}

void msl_protect_readonly(void* p) {
  Buffer* b = find_buffer(p);
  if (!b) return;
  size_t page = sysconf(_SC_PAGESIZE);
  mprotect(b->map + page, b->map_len - 2 * page, PROT_READ);
}

// 0 when the canary bytes around buffer p are intact, else writes a message.
int msl_check_canary(void* p, char* err, int errlen) {
  Buffer* b = find_buffer(p);
  if (!b) return 0;
  size_t page = sysconf(_SC_PAGESIZE);
  char* lo = b->map + page;
  char* hi = b->map + b->map_len - page;
  for (char* c = lo; c < b->data; ++c)
    if ((unsigned char)*c != kCanary) {
      snprintf(err, errlen, "a write %zu bytes before the start of buffer '%s'",
               (size_t)(b->data - c), b->name);
      return 1;
    }
  for (char* c = b->data + b->bytes; c < hi; ++c)
    if ((unsigned char)*c != kCanary) {
      snprintf(err, errlen, "a write %zu bytes past the end of buffer '%s' (%zu bytes)",
               (size_t)(c - b->data - b->bytes), b->name, b->bytes);
      return 1;
    }
  return 0;
}

void msl_free(void* p) {
  for (size_t i = 0; i < g_buffers.size(); ++i) {
    if (g_buffers[i].data != p) continue;
    delete g_buffers[i].writes;
    munmap(g_buffers[i].map, g_buffers[i].map_len);
    g_buffers.erase(g_buffers.begin() + (long)i);
    return;
  }
}

// Runs the whole grid. grid counts threads (as mx.fast.metal_kernel's `grid`);
// the threadgroup is clamped to the grid, so edge groups may be partial.
// schedule: 0 serial, 1 reversed, 2 random(seed). Returns 0, or 1 with `err` set.
int msl_launch(void** buffers, const int* grid, const int* tg, int schedule, uint64_t seed,
               char* err, int errlen) {
  unsigned gs[3], ts[3], ng[3];
  for (int d = 0; d < 3; ++d) {
    if (grid[d] < 1 || tg[d] < 1) {
      snprintf(err, errlen, "grid and threadgroup sizes must be positive");
      return 1;
    }
    gs[d] = (unsigned)grid[d];
    ts[d] = std::min((unsigned)tg[d], gs[d]);
    ng[d] = (gs[d] + ts[d] - 1) / ts[d];
  }
  if ((long)ts[0] * ts[1] * ts[2] > kMaxThreads) {
    snprintf(err, errlen, "threadgroup of %u threads exceeds the %d Metal allows",
             ts[0] * ts[1] * ts[2], kMaxThreads);
    return 1;
  }
  R.buffers = buffers;
  R.simd_ops = R.simdgroup_barriers = R.threadgroup_barriers = 0;
  R.device_bytes_read = R.device_bytes_written = 0;
  R.failed = false;
  R.error.clear();
  std::mt19937_64 rng(seed);
  ensure_stacks((int)(ts[0] * ts[1] * ts[2]));
  // Threadgroups run one at a time in grid order (serial), reversed, or shuffled
  // (random): a kernel whose result depends on the order of threadgroups differs.
  std::vector<unsigned> group_order((size_t)ng[0] * ng[1] * ng[2]);
  for (size_t i = 0; i < group_order.size(); ++i) group_order[i] = (unsigned)i;
  if (schedule == 1) std::reverse(group_order.begin(), group_order.end());
  if (schedule == 2) std::shuffle(group_order.begin(), group_order.end(), rng);
  for (unsigned linear_group : group_order) {
    const unsigned gx = linear_group % ng[0];
    const unsigned gy = (linear_group / ng[0]) % ng[1];
    const unsigned gz = linear_group / (ng[0] * ng[1]);
    {
      {
        unsigned ax = std::min(ts[0], gs[0] - gx * ts[0]);
        unsigned ay = std::min(ts[1], gs[1] - gy * ts[1]);
        unsigned az = std::min(ts[2], gs[2] - gz * ts[2]);
        int n = (int)(ax * ay * az);
        int nsg = (n + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH;
        R.fibers.assign(n, Fiber());
        R.snapshots.assign((size_t)nsg * MSL_SIMD_WIDTH * MSL_SIMD_SLOT, 0);
        R.active_masks.assign(nsg, 0);
        R.epoch++;
        R.tg_bytes_this_group = 0;
        for (int i = 0; i < n; ++i) {
          Fiber& f = R.fibers[i];
          unsigned lx = i % ax, ly = (i / ax) % ay, lz = i / (ax * ay);
          msl_thread_attrs& a = f.attrs;
          a.thread_index_in_threadgroup = i;
          uint3_set(a.thread_position_in_threadgroup, lx, ly, lz);
          uint3_set(a.threadgroup_position_in_grid, gx, gy, gz);
          uint3_set(a.thread_position_in_grid, gx * ts[0] + lx, gy * ts[1] + ly, gz * ts[2] + lz);
          uint3_set(a.threads_per_threadgroup, ax, ay, az);
          uint3_set(a.dispatch_threads_per_threadgroup, ts[0], ts[1], ts[2]);
          uint3_set(a.threadgroups_per_grid, ng[0], ng[1], ng[2]);
          uint3_set(a.threads_per_grid, gs[0], gs[1], gs[2]);
          uint3_set(a.grid_size, gs[0], gs[1], gs[2]);
          uint3_set(a.grid_origin, 0, 0, 0);
          a.thread_execution_width = MSL_SIMD_WIDTH;
          a.threads_per_simdgroup = MSL_SIMD_WIDTH;
          a.simdgroup_index_in_threadgroup = i / MSL_SIMD_WIDTH;
          a.thread_index_in_simdgroup = i % MSL_SIMD_WIDTH;
          a.simdgroups_per_threadgroup = nsg;
          a.dispatch_simdgroups_per_threadgroup =
              (ts[0] * ts[1] * ts[2] + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH;
          a.quadgroup_index_in_threadgroup = i / 4;
          a.thread_index_in_quadgroup = i % 4;
          a.quadgroups_per_threadgroup = (n + 3) / 4;
          a.dispatch_quadgroups_per_threadgroup = (ts[0] * ts[1] * ts[2] + 3) / 4;
          f.linear = i;
          start_fiber(f, i);
        }
        if (!run_group(schedule, rng)) {
          snprintf(err, errlen, "%s", R.error.c_str());
          return 1;
        }
      }
    }
  }
  return 0;
}


// Counters of the last launch: simd_ops, simdgroup_barriers, threadgroup_barriers,
// device_bytes_read, device_bytes_written (the byte counts only in counting builds).
void msl_last_counts(uint64_t* out) {
  out[0] = R.simd_ops;
  out[1] = R.simdgroup_barriers;
  out[2] = R.threadgroup_barriers;
  out[3] = R.device_bytes_read;
  out[4] = R.device_bytes_written;
}

// Record how many times each byte of buffer p is stored to (counting builds).
void msl_track_writes(void* p) {
  Buffer* b = find_buffer(p);
  if (b && !b->writes) b->writes = new std::vector<unsigned char>(b->bytes, 0);
}

// 0 when every element (itemsize bytes) of tracked buffer p was stored exactly once,
// else 1 with a message naming the first element that was not.
int msl_check_writes(void* p, int itemsize, char* err, int errlen) {
  Buffer* b = find_buffer(p);
  if (!b || !b->writes) return 0;
  const std::vector<unsigned char>& w = *b->writes;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] == 1) continue;
    snprintf(err, errlen, "element %zu of output '%s' was written %d time%s (every output element "
             "must be written exactly once)", i / (size_t)itemsize, b->name, (int)w[i],
             w[i] == 1 ? "" : "s");
    return 1;
  }
  return 0;
}

// Memory-access callbacks of counting builds: the kernel is compiled with
// -fsanitize=address and a call threshold of 0, so every load and store it makes
// calls one of these (no ASan runtime is linked; these are the only definitions).
static void msl_count_access(uintptr_t addr, size_t n, bool store) {
  if (!R.current) return;
  for (auto& b : g_buffers) {
    uintptr_t lo = (uintptr_t)b.data;
    if (addr < lo || addr >= lo + b.bytes) continue;
    if (!store) {
      R.device_bytes_read += n;
      return;
    }
    R.device_bytes_written += n;
    if (b.writes) {
      size_t off = addr - lo;
      for (size_t i = 0; i < n && off + i < b.bytes; ++i) {
        unsigned char& c = (*b.writes)[off + i];
        if (c < 255) ++c;
      }
    }
    return;
  }
}
void __asan_init(void) {}
void __asan_version_mismatch_check_v8(void) {}
void __asan_handle_no_return(void) {}
#define MSL_ACCESS_HOOKS(n)                                                        \
  void __asan_load##n(uintptr_t a) { msl_count_access(a, n, false); }              \
  void __asan_store##n(uintptr_t a) { msl_count_access(a, n, true); }              \
  void __asan_load##n##_noabort(uintptr_t a) { msl_count_access(a, n, false); }    \
  void __asan_store##n##_noabort(uintptr_t a) { msl_count_access(a, n, true); }
MSL_ACCESS_HOOKS(1)
MSL_ACCESS_HOOKS(2)
MSL_ACCESS_HOOKS(4)
MSL_ACCESS_HOOKS(8)
MSL_ACCESS_HOOKS(16)
#undef MSL_ACCESS_HOOKS
void __asan_loadN(uintptr_t a, size_t n) { msl_count_access(a, n, false); }
void __asan_storeN(uintptr_t a, size_t n) { msl_count_access(a, n, true); }
void __asan_loadN_noabort(uintptr_t a, size_t n) { msl_count_access(a, n, false); }
void __asan_storeN_noabort(uintptr_t a, size_t n) { msl_count_access(a, n, true); }
void* __asan_memcpy(void* d, const void* s, size_t n) {
  msl_count_access((uintptr_t)s, n, false);
  msl_count_access((uintptr_t)d, n, true);
  return std::memcpy(d, s, n);
}
void* __asan_memmove(void* d, const void* s, size_t n) {
  msl_count_access((uintptr_t)s, n, false);
  msl_count_access((uintptr_t)d, n, true);
  return std::memmove(d, s, n);
}
void* __asan_memset(void* d, int c, size_t n) {
  msl_count_access((uintptr_t)d, n, true);
  return std::memset(d, c, n);
}


// Handlers of ubsan builds (-fsanitize-minimal-runtime, no ubsan runtime linked):
// report the check and the faulting call site (mapped to the .metal line by the
// parent), then end the worker like a fault.
static void msl_undefined_behaviour(const char* kind, void* ret) {
  char thr[256] = "outside any Metal thread";
  if (R.current) snprintf(thr, sizeof thr, "%s", thread_str(*R.current).c_str());
  char pc_info[512] = "";
  void* pc = (char*)ret - 1;
  Dl_info dl;
  if (dladdr(pc, &dl) && dl.dli_fname)
    snprintf(pc_info, sizeof pc_info, "\nMSL_FAULT_PC %s 0x%lx", dl.dli_fname,
             (unsigned long)((char*)pc - (char*)dl.dli_fbase));
  std::fprintf(stderr, "MSL_FAULT undefined behaviour: %s; in %s%s\n", kind, thr, pc_info);
  std::fflush(stderr);
  _exit(79);
}
#define MSL_UB_HANDLER(name, what)                                                           \
  void __ubsan_handle_##name##_minimal(void) {                                               \
    msl_undefined_behaviour(what, __builtin_return_address(0));                              \
  }                                                                                          \
  void __ubsan_handle_##name##_minimal_abort(void) {                                         \
    msl_undefined_behaviour(what, __builtin_return_address(0));                              \
  }
MSL_UB_HANDLER(add_overflow, "signed integer overflow in +")
MSL_UB_HANDLER(sub_overflow, "signed integer overflow in -")
MSL_UB_HANDLER(mul_overflow, "signed integer overflow in *")
MSL_UB_HANDLER(negate_overflow, "signed integer overflow in unary -")
MSL_UB_HANDLER(divrem_overflow, "signed integer overflow in / or %")
MSL_UB_HANDLER(type_mismatch, "misaligned (or null) pointer access")
MSL_UB_HANDLER(alignment_assumption, "misaligned pointer")
MSL_UB_HANDLER(out_of_bounds, "array index out of bounds")
MSL_UB_HANDLER(shift_out_of_bounds, "shift out of bounds")
MSL_UB_HANDLER(pointer_overflow, "pointer overflow")
#undef MSL_UB_HANDLER

}  // extern "C"

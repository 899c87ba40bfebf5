// Fiber scheduler of the CPU emulator (see emu.h).
//
// A launch runs its blocks (clusters) one at a time, in the grid's order or
// in one drawn from the launch seed. Each thread of a block is a fiber
// with its own stack (switched by tpar_emu_switch below, with no system
// call; on other than x86-64, by ucontext). A fiber runs until it reaches a block
// barrier or a warp operation; the scheduler then runs the other runnable
// fibers: warps one at a time in an order shuffled from the launch seed,
// each up to its next barrier, so that a missing barrier between one warp's
// write and another's read usually shows.
// A barrier completes when every live thread of the block has reached it; a
// warp operation when every live lane of the warp has. When nothing can run
// and nothing can complete, the launch fails with a deadlock report.
#include <cxxabi.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "emu.h"

// Fiber switches. swapcontext saves and restores the signal mask, a system
// call each way, and the emulator switches fibers millions of times per
// test: on x86-64 a switch is the callee-saved registers, the SSE and x87
// control words and the stack pointer, saved on the stack being left
// (tpar_emu_switch), so no system call is made. Elsewhere, ucontext.
#if defined(__x86_64__)
#define TPAR_EMU_FAST_SWITCH 1
extern "C" {
// Saves the callee-saved state on the current stack, stores the stack
// pointer in *from and resumes the state saved at `to`.
void tpar_emu_switch(void** from, void* to);
// A new fiber's first return lands here: it calls tpar_emu_fiber_main (which
// never returns) on the fiber's stack, aligned as for a call.
void tpar_emu_fiber_start();
void tpar_emu_fiber_main();
}
asm(R"(
    .text
    .globl tpar_emu_switch
    .hidden tpar_emu_switch
    .type tpar_emu_switch, @function
tpar_emu_switch:
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
    .size tpar_emu_switch, .-tpar_emu_switch

    .globl tpar_emu_fiber_start
    .hidden tpar_emu_fiber_start
    .type tpar_emu_fiber_start, @function
tpar_emu_fiber_start:
    andq $-16, %rsp
    call tpar_emu_fiber_main
    ud2
    .size tpar_emu_fiber_start, .-tpar_emu_fiber_start
)");
#endif

#ifdef TPAR_EMU_RACECHECK
#include <link.h>

#include <deque>
#include <map>
#endif

namespace {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, AT_GROUP, AT_MBAR, AT_CLUSTER, AT_REGS, DONE };

// A wgmma.mma_async issued by one thread whose results it has not yet
// waited for: they reach the registers at wgmma.wait_group (until then the
// registers hold NaN, so a read before the wait shows).
struct WgmmaPending {
    float* d = nullptr;
    int count = 0;  // registers (N / 2)
    int group = -1;  // commit group, -1 while not committed
    u32 agent = 0, agent_clk = 0;  // racecheck: the operation's shared-memory reads
    float vals[128];
};

// A bulk asynchronous reduction (cp.reduce.async.bulk) issued by one thread
// and not yet completed by a cp.async.bulk.wait_group.
struct BulkPending {
    float* dst = nullptr;
    const float* src = nullptr;
    unsigned count = 0;  // floats
    int group = -1;      // bulk async-group, -1 while not committed
};

// Completes (`done`, oldest first) and drops the operations of `pending`
// committed to a group before `keep_from`; later groups and operations not
// yet committed (group -1) stay pending.
template <typename P, typename F>
void retire_groups(std::vector<P>& pending, int keep_from, F done) {
    std::vector<P> rest;
    for (auto& p : pending) {
        if (p.group >= 0 && p.group < keep_from)
            done(p);
        else
            rest.push_back(p);
    }
    pending.swap(rest);
}

struct Fiber {
#ifdef TPAR_EMU_FAST_SWITCH
    void* sp = nullptr;  // the saved stack pointer while switched out
#else
    ucontext_t ctx;
#endif
    dim3 tid;
    int lane = 0, warp = 0;
    State state = RUNNABLE;
    void* in = nullptr;
    void* out = nullptr;
    tpar_emu_combine_fn combine = nullptr;
    int kind = 0;
    // AT_MBAR: the barrier and the parity of the phase waited for
    const void* mbar = nullptr;
    unsigned parity = 0;
    unsigned cta = 0;    // rank of its block in the cluster
    unsigned local = 0;  // linear thread index in its block
    unsigned group = 0;  // its warpgroup in Launch::groups
    std::vector<WgmmaPending> wgmma;
    int wgmma_groups = 0;  // groups committed so far
    int wgmma_done = 0;    // groups retired by wait_group
    std::vector<BulkPending> bulk;
    int bulk_groups = 0;  // bulk async-groups committed so far
    // setmaxnreg: the registers the thread holds, and (AT_REGS) how many more
    // setmaxnreg.inc waits for
    unsigned regs = 0;
    unsigned reg_need = 0;
    // racecheck: the agent clocks of this thread's asynchronous operations
    // that complete by a wait of its own (bulk stores and reductions,
    // cp.async), with their group (-1 until committed)
    std::vector<std::pair<int, u32>> race_bulk, race_cpa;
    int cpa_groups = 0;
};

// A warpgroup (4 consecutive warps, 128 threads) at a warpgroup collective.
struct Group {
    int arrived = 0;
    int live = 0;
    tpar_emu_combine_fn combine = nullptr;
    int kind = 0;
    Fiber* threads[128] = {};
    // racecheck: the agent and clock of the last wgmma's shared-memory reads
    u32 race_agent = 0, race_clk = 0;
};

// An mbarrier object (PTX ISA "Parallel synchronization and communication
// instructions: mbarrier"): a phase completes when its pending arrival count
// and its transaction count are both zero; the next phase then starts with
// the expected arrival count again.
struct Mbar {
    unsigned expected = 0;
    unsigned pending = 0;
    long long tx = 0;
    unsigned phase = 0;
    // racecheck: what the arrivals and completed transactions of the current
    // phase release, and what the last completed phase of each parity did
    std::vector<u32> acc, done[2];
};

struct Warp {
    int arrived = 0;
    int live = 0;
    tpar_emu_combine_fn combine = nullptr;
    int kind = 0;
    Fiber* lanes[32] = {};
};

constexpr size_t kStack = 256 * 1024;
// Below each fiber's stack, addresses mapped with no access: a thread whose
// stack outgrows kStack faults there (reported as a stack overflow) instead of
// writing into the next fiber's stack.
constexpr size_t kGuard = 64 * 1024;
constexpr size_t kMaxDynSmem = 227 * 1024;

// One block of the cluster running.
struct Cta {
    dim3 bidx{};
    std::vector<unsigned char> dyn_smem;
    // dynamic shared memory, 1024-byte aligned (the emulated shared window)
    unsigned char* smem = nullptr;
    // threads not yet exited: once 0, the block's shared memory is gone for
    // the rest of its cluster
    unsigned live = 0;
    // setmaxnreg's per-block pool: registers released by setmaxnreg.dec and
    // not yet taken by setmaxnreg.inc (counted per thread, summed)
    unsigned long long reg_pool = 0;
};

// The registers per thread a block of `threads` threads holds at entry when
// it is compiled for one block per SM with that many threads (the launch
// bounds of the kernels that use setmaxnreg): the 64K-register file's share,
// in ptxas's units of 8, at most 255.
unsigned entry_registers(unsigned threads) {
    const unsigned share = threads ? 65536u / threads / 8u * 8u : 255u;
    return share < 255u ? share : 255u;
}

struct Launch {
    void (*kernel)(const void*) = nullptr;
    const void* args = nullptr;
    size_t args_len = 0;
    // memcheck: every global access must lie in a registered allocation
    // (launches on device memory the host side registers; tpar_emu_track)
    bool strict = false;
    dim3 grid{}, block{}, cluster{1, 1, 1};
    unsigned csize = 1;  // blocks per cluster
    std::vector<Cta> ctas;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<Group> groups;
    std::unordered_map<const void*, Mbar> mbars;
    size_t smem_bytes = 0;
#ifdef TPAR_EMU_FAST_SWITCH
    void* sched_sp = nullptr;
#else
    ucontext_t sched;
#endif
    Fiber* current = nullptr;
    std::string error;
    unsigned long long rng = 0;
    // The order the clusters run in: run c (from 0) is cluster (a c + b) mod
    // count of the grid (x fastest, then y, then z); a = 1, b = 0 is the
    // grid's own order.
    unsigned long long order_a = 1, order_b = 0, order_count = 1;
    unsigned long long cluster_of(unsigned long long run) const {
        return (unsigned long long)(((unsigned __int128)order_a * run + order_b) % order_count);
    }
    // a hardware fault of the running fiber (see on_fault): signal 0 if none
    struct {
        int signo = 0, code = 0;
        const void* addr = nullptr;
        const void* pc = nullptr;
    } fault;
};

thread_local Launch* g_launch = nullptr;

// Switches from the running fiber to the scheduler.
inline void to_scheduler(Launch* L) {
#ifdef TPAR_EMU_FAST_SWITCH
    tpar_emu_switch(&L->current->sp, L->sched_sp);
#else
    swapcontext(&L->current->ctx, &L->sched);
#endif
}

// Switches from the scheduler to fiber `f`.
inline void to_fiber(Launch* L, Fiber& f) {
#ifdef TPAR_EMU_FAST_SWITCH
    tpar_emu_switch(&L->sched_sp, f.sp);
#else
    swapcontext(&L->sched, &f.ctx);
#endif
}

std::mutex g_mutex;  // `__shared__` statics are process-wide: one launch at a time
std::vector<char*> g_stacks;

unsigned long long next_rand(Launch* L) {
    unsigned long long x = L->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    L->rng = x;
    return x;
}

void fail(Launch* L, const std::string& what) {
    if (L->error.empty()) L->error = what;
}

std::string where(const Fiber* f) {
    char buf[160];
    const dim3& b = g_launch->ctas[f->cta].bidx;
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", b.x, b.y, b.z, f->tid.x,
                  f->tid.y, f->tid.z);
    return buf;
}

// Dynamic shared memory of the running thread's block.
unsigned char* cur_smem(Launch* L) { return L->ctas[L->current ? L->current->cta : 0].smem; }

// " in <function>" for the code address `pc`, or "" if no symbol holds it.
std::string function_of(const void* pc) {
    if (!pc) return "";
    Dl_info info;
    if (!dladdr(pc, &info) || !info.dli_sname) return "";
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string name = status == 0 && d ? d : info.dli_sname;
    std::free(d);
    return " in " + name;
}

#ifdef TPAR_EMU_RACECHECK
// ---------------------------------------------------------------- racecheck
//
// With TPAR_EMU_RACECHECK (src/cuda/emu.rs builds a second runtime and the
// kernels with it), kernel sources are compiled with -fsanitize=thread,
// whose instrumentation calls the __tsan_* hooks below (defined here: no
// ThreadSanitizer runtime is linked) on every load and store of kernel code,
// and this file checks the accesses to shared memory (each block's dynamic
// shared memory, and `__shared__` statics: the writable data of the kernel
// libraries) for data races, as compute-sanitizer's racecheck does on a GPU,
// and those to global memory (anything else but the fibers' stacks and the
// runtime's state): between the threads of a block the same way, and between
// blocks, which nothing orders within a launch, any two accesses to one byte
// (one a write, not both atomics) are a race.
//
// Happens-before is tracked with vector clocks over the cluster's threads and
// one "agent" per thread standing for the asynchronous operations it issues
// (bulk tensor copies, bulk reductions, cp.async, wgmma). An asynchronous
// operation's accesses are checked against what its issuer knew when it
// issued it, and recorded under the issuer's agent; the issuer (or anyone)
// learns they are done only through the completion mechanism the ISA gives:
// complete_tx on an mbarrier (bulk tensor loads), wgmma.wait_group,
// cp.async.bulk.wait_group (bulk stores and reductions) and
// cp.async.wait_group. Release and acquire: __syncthreads, __syncwarp,
// barrier.cluster, mbarrier arrivals (release) and completed phase waits
// (acquire). Shuffles, votes and warpgroup operations order nothing.
// A conflicting pair (one a write, not both atomic) whose accesses no chain
// of these orders fails the launch with both accesses named. An
// asynchronous read (a bulk store's or a reduction's source, a wgmma
// operand) of shared memory that a thread wrote with ordinary stores also
// needs that thread's fence.proxy.async between the write and what orders it
// before the operation; its absence is reported too, and so is a load of
// shared memory that nothing in its block has written.
//
// Granularity: bytes (threads that write neighbouring bytes do not race).
namespace race {

enum Kind : u8 { NONE = 0, GENERIC = 1, ASYNC = 2, ATOMIC = 3 };

struct Epoch {
    u32 id = 0;
    u32 clk = 0;  // 0: no access
};

struct Cell {
    Epoch w;
    u8 wkind = NONE;
    Epoch r;        // the reader, when there is one ordered after every other
    u32 set = 0;    // else 1 + index of the readers' set
};

// A byte of global memory: its cell for the accesses of the running cluster,
// the clusters of its last writer and readers, and a reader of an earlier
// cluster (another block of the launch, which nothing orders with this one).
struct GCell {
    Cell c;
    u32 wrun = 0, rrun = 0;
    u32 frun = 0;  // an earlier cluster that read it since the last write, or 0
    Epoch fr;      // that reader
    Epoch lr;      // the last reader
};

struct State {
    unsigned n = 0;  // threads of the cluster (ids 0..n); agents n..2n
    unsigned V = 0;
    std::vector<u32> vc;     // n rows of V clocks
    std::vector<u32> agent;  // each thread's agent clock
    std::vector<std::vector<u32>> fences;  // each thread's fence.proxy.async clocks
    std::vector<std::vector<Cell>> win;    // per block of the cluster: its dynamic shared memory
    std::unordered_map<uintptr_t, Cell> statics;
    std::vector<std::pair<uintptr_t, uintptr_t>> static_ranges;
    uintptr_t st_lo = 0, st_hi = 0;
    unsigned long long libs_seen = ~0ull;
    std::vector<std::vector<Epoch>> sets;
    std::vector<u32> tmp;
    bool stop = false;
    // global memory, over the whole launch: the cluster ("run", from 1) of
    // each cell's last writer and readers
    std::unordered_map<uintptr_t, GCell> global;
    u32 run = 0;
    // what kernel code reads that is neither shared nor global memory: the
    // fibers' stacks and the runtime's launch state (sorted ranges)
    std::vector<std::pair<uintptr_t, uintptr_t>> skip;
};

State g;

u32* row(unsigned t) { return &g.vc[(size_t)t * g.V]; }
unsigned fid(const Launch* L, const Fiber* f) { return (unsigned)(f - L->fibers.data()); }
void tick(unsigned t) { row(t)[t]++; }
void join(u32* dst, const u32* src) {
    for (unsigned i = 0; i < g.V; ++i) dst[i] = dst[i] > src[i] ? dst[i] : src[i];
}

int collect_static(struct dl_phdr_info* info, size_t, void*) {
    const char* name = info->dlpi_name ? info->dlpi_name : "";
    if (!std::strstr(name, "libtpar_emu_") || std::strstr(name, "libtpar_emu_rt")) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
        const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
        g.static_ranges.push_back({lo, lo + ph.p_memsz});
    }
    return 0;
}

int count_objects(struct dl_phdr_info* info, size_t, void* data) {
    auto* adds = static_cast<unsigned long long*>(data);
    *adds = info->dlpi_adds + 1000003ull * info->dlpi_subs;
    return 1;
}

// A new cluster: fresh clocks and shadows (blocks run one cluster at a time,
// and a block's shared memory starts unwritten).
void begin_cluster(Launch* L) {
    g.n = (unsigned)L->fibers.size();
    g.V = 2 * g.n;
    g.vc.assign((size_t)g.n * g.V, 0);
    for (unsigned t = 0; t < g.n; ++t) row(t)[t] = 1;
    g.agent.assign(g.n, 0);
    g.fences.assign(g.n, {});
    g.win.assign(L->csize, {});
    for (auto& w : g.win) w.assign(L->smem_bytes, Cell{});
    g.statics.clear();
    g.sets.clear();
    g.stop = false;
    g.run++;
    g.skip.clear();
    for (unsigned t = 0; t < g.n && t < g_stacks.size(); ++t)
        g.skip.push_back({reinterpret_cast<uintptr_t>(g_stacks[t]),
                          reinterpret_cast<uintptr_t>(g_stacks[t]) + kStack});
    auto skip = [](const void* p, size_t bytes) {
        g.skip.push_back({reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes});
    };
    skip(L, sizeof(Launch));
    skip(L->args, L->args_len);
    skip(L->fibers.data(), L->fibers.size() * sizeof(Fiber));
    skip(L->ctas.data(), L->ctas.size() * sizeof(Cta));
    std::sort(g.skip.begin(), g.skip.end());
    unsigned long long adds = 0;
    dl_iterate_phdr(count_objects, &adds);
    if (adds != g.libs_seen) {
        g.libs_seen = adds;
        g.static_ranges.clear();
        dl_iterate_phdr(collect_static, nullptr);
        g.st_lo = ~(uintptr_t)0;
        g.st_hi = 0;
        for (auto& r : g.static_ranges) {
            g.st_lo = std::min(g.st_lo, r.first);
            g.st_hi = std::max(g.st_hi, r.second);
        }
    }
    for (auto& m : L->mbars) {
        m.second.acc.assign(g.V, 0);
        m.second.done[0].assign(g.V, 0);
        m.second.done[1].assign(g.V, 0);
    }
}

// Thread `e.id` (or its agent) of cluster `run` (the running one, or one that
// has ended): its block and thread from the launch's shape.
std::string who(const Launch* L, Epoch e, u32 run = g.run) {
    const unsigned id = e.id < g.n ? e.id : e.id - g.n;
    const unsigned per_block = L->block.x * L->block.y * L->block.z;
    const unsigned r = id / per_block, j = id % per_block;
    // the cluster the run was (tpar_emu_launch_cluster), x fastest, then y, then z
    const unsigned cx = L->grid.x / L->cluster.x, cy = L->grid.y / L->cluster.y;
    const unsigned c = (unsigned)L->cluster_of(run - 1);
    const unsigned x = (c % cx) * L->cluster.x + r % L->cluster.x;
    const unsigned y = ((c / cx) % cy) * L->cluster.y + (r / L->cluster.x) % L->cluster.y;
    const unsigned z = (c / (cx * cy)) * L->cluster.z + r / (L->cluster.x * L->cluster.y);
    char buf[200];
    std::snprintf(buf, sizeof buf, "%sblock (%u,%u,%u) thread (%u,%u,%u)",
                  e.id < g.n ? "" : "an asynchronous operation of ", x, y, z, j % L->block.x,
                  (j / L->block.x) % L->block.y, j / (L->block.x * L->block.y));
    return buf;
}

struct Access {
    Epoch me;
    const u32* vc;  // what the accessor knows
    Kind kind;
    bool write;
    const char* what;  // "a store", "a bulk tensor copy's write", ...
    const void* pc;
};

// Where a tracked byte lies: "<region> at byte <offset>", a __shared__
// variable by its name.
std::string place(const char* region, uintptr_t off, uintptr_t addr) {
    char buf[200];
    Dl_info info;
    void* extra = nullptr;
    // the exported symbol holding the byte (function-local statics are not
    // exported: those are named by their offset)
    if (std::strcmp(region, "a __shared__ variable") == 0 &&
        dladdr1(reinterpret_cast<void*>(addr), &info, &extra, RTLD_DL_SYMENT) &&
        info.dli_sname && info.dli_saddr && extra &&
        addr < reinterpret_cast<uintptr_t>(info.dli_saddr) +
                   static_cast<const ElfW(Sym)*>(extra)->st_size) {
        int status = 0;
        char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        std::snprintf(buf, sizeof buf, "the __shared__ variable %s at byte %llu",
                      status == 0 && d ? d : info.dli_sname,
                      (unsigned long long)(addr - reinterpret_cast<uintptr_t>(info.dli_saddr)));
        std::free(d);
        return buf;
    }
    const bool statics = std::strcmp(region, "a __shared__ variable") == 0;
    std::snprintf(buf, sizeof buf, "%s at byte %#llx%s", region, (unsigned long long)off,
                  statics ? " of the kernel library's data" : "");
    return buf;
}

// Fails the launch with a conflict between access `a` and an earlier one,
// `other`, of cluster `run` (another block of the launch when not the running
// one).
void report(Launch* L, const char* hazard, const Access& a, Epoch other, u32 run,
            const char* other_what, const std::string& at) {
    if (g.stop) return;
    g.stop = true;
    fail(L, std::string("racecheck: ") + hazard + " hazard on " + at + ": " + a.what + " by " +
                who(L, a.me) + function_of(a.pc) + " and an earlier " + other_what + " by " +
                who(L, other, run) +
                (run == g.run ? ", which no synchronization orders before it"
                              : ", another block of the same launch (nothing orders the blocks "
                                "of a launch)"));
}

// What the last write to `c` was, for a report.
const char* write_kind(const Cell& c) {
    return c.wkind == ASYNC ? "asynchronous write" : c.wkind == ATOMIC ? "atomic" : "write";
}

bool before(Epoch e, const u32* vc) { return e.clk == 0 || vc[e.id] >= e.clk; }

const char kGlobal[] = "global memory";

void access(Launch* L, Cell& c, const Access& a, const char* region, uintptr_t off,
            uintptr_t addr) {
    if (c.w.clk && !before(c.w, a.vc) && !(a.kind == ATOMIC && c.wkind == ATOMIC)) {
        report(L, a.write ? "write-after-write" : "read-after-write", a, c.w, g.run, write_kind(c),
               place(region, off, addr));
        return;
    }
    if (!a.write && a.kind == GENERIC && c.w.clk == 0 && region != kGlobal && !g.stop) {
        // shared memory no thread of the block has written: what the load
        // returns is whatever an earlier block left there
        g.stop = true;
        fail(L, std::string("racecheck: ") + a.what + " by " + who(L, a.me) + function_of(a.pc) +
                    " reads " + place(region, off, addr) +
                    ", which nothing in its block has written (uninitialized shared memory)");
        return;
    }
    if (!a.write && a.kind == ASYNC && c.wkind == GENERIC && c.w.id < g.n) {
        // an asynchronous read of an ordinary store: the writer's
        // fence.proxy.async must lie between the store and the ordering
        const auto& fs = g.fences[c.w.id];
        auto it = std::lower_bound(fs.begin(), fs.end(), c.w.clk);
        if (it == fs.end() || a.vc[c.w.id] <= *it) {
            if (g.stop) return;
            g.stop = true;
            const std::string buf = place(region, off, addr);
            fail(L, std::string("racecheck: ") + a.what + " by " + who(L, a.me) + " reads " +
                        buf + ", written by " + who(L, c.w) +
                        " with an ordinary store that no fence.proxy.async of that thread "
                        "makes visible to the asynchronous proxy (fence_proxy_async() after "
                        "the store, before the synchronization that orders it)");
            return;
        }
    }
    if (a.write) {
        auto check = [&](Epoch r) {
            if (r.clk && r.id != a.me.id && !before(r, a.vc)) {
                report(L, "write-after-read", a, r, g.run,
                       r.id >= g.n ? "asynchronous read" : "read", place(region, off, addr));
                return false;
            }
            return true;
        };
        if (c.set) {
            for (Epoch r : g.sets[c.set - 1])
                if (!check(r)) return;
            g.sets[c.set - 1].clear();
            c.set = 0;
        } else if (!check(c.r)) {
            return;
        }
        c.r = Epoch{};
        c.w = a.me;
        c.wkind = a.kind;
        return;
    }
    // a read: keep every reader not ordered before a later one
    if (!c.set) {
        if (c.r.clk == 0 || c.r.id == a.me.id || before(c.r, a.vc)) {
            c.r = a.me;
            return;
        }
        g.sets.push_back({c.r, a.me});
        c.set = (u32)g.sets.size();
        c.r = Epoch{};
        return;
    }
    auto& set = g.sets[c.set - 1];
    size_t k = 0;
    for (Epoch r : set)
        if (r.id != a.me.id && !before(r, a.vc)) set[k++] = r;
    set.resize(k);
    set.push_back(a.me);
}

// An access to a byte of global memory.
void global_access(Launch* L, uintptr_t x, const Access& a) {
    GCell& gc = g.global[x];
    Cell& c = gc.c;
    const u32 R = g.run;
    if (c.w.clk && gc.wrun != R) {
        if (!(a.kind == ATOMIC && c.wkind == ATOMIC)) {
            report(L, a.write ? "write-after-write" : "read-after-write", a, c.w, gc.wrun,
                   write_kind(c), place(kGlobal, x, x));
            return;
        }
        c.w = Epoch{};
    }
    if (gc.rrun != R && (c.r.clk || c.set)) {
        // readers of an earlier cluster: keep one for the report
        gc.frun = gc.rrun;
        gc.fr = gc.lr;
        c.r = Epoch{};
        c.set = 0;
    }
    if (gc.rrun != R) gc.rrun = R;
    if (a.write && gc.frun) {
        report(L, "write-after-read", a, gc.fr, gc.frun, "read", place(kGlobal, x, x));
        return;
    }
    access(L, c, a, kGlobal, x, x);
    if (a.write) {
        gc.wrun = R;
        gc.frun = 0;
    } else {
        gc.lr = a.me;
    }
}

bool skipped(uintptr_t a) {
    auto it = std::upper_bound(g.skip.begin(), g.skip.end(),
                               std::make_pair(a, ~(uintptr_t)0));
    return it != g.skip.begin() && a < (it - 1)->second;
}

// ---------------------------------------------------------------- memcheck
//
// The same instrumentation checks every access as compute-sanitizer's memcheck
// does on a GPU:
// - an access the compiler emits as aligned (__tsan_readN / writeN for N = 2,
//   4, 8, 16: the type promises N-byte alignment, which a GPU load or store of
//   that width requires, else the launch faults) at an address that is not a
//   multiple of N, and an atomic at an address not a multiple of its size;
// - an access of dynamic shared memory outside the bytes the launch gave the
//   block (the checked window holds 227 KiB from the block's start, the most a
//   block can have, and 1 KiB before it, so such an offset shows);
// - on launches whose global memory is registered (Launch::strict: an
//   EmulatedGpu's device buffers, through tpar_emu_track), an access of global
//   memory that does not lie inside one live allocation: past an allocation's
//   end, before its start, or in one already freed; and (initcheck) a read of
//   bytes of an allocation that nothing has written since it was allocated (a
//   kernel's stores, bulk stores and atomics write; so do the host side's
//   copies and memsets, which it reports through tpar_emu_written).
// The thread stops before the access (its fiber is never resumed, so nothing
// out of bounds is read or written) and the launch fails naming the access,
// the address and the nearest allocation, the thread and the function.
struct Alloc {
    uintptr_t end;
    std::vector<u8> written;  // one bit per byte
};
struct Allocs {
    std::mutex mu;
    std::map<uintptr_t, Alloc> live;                    // by start
    std::deque<std::pair<uintptr_t, uintptr_t>> freed;  // the last frees, newest last
};
Allocs& allocs() {
    static Allocs a;
    return a;
}
constexpr size_t kFreedKept = 4096;

// Marks [at, at + bytes) of allocation `a` (starting at `start`) written.
void mark_written(Alloc& a, uintptr_t start, uintptr_t at, size_t bytes) {
    for (uintptr_t x = at - start, e = std::min<uintptr_t>(x + bytes, a.end - start); x < e; ++x)
        a.written[x >> 3] |= (u8)(1u << (x & 7));
}

// The allocation holding `at`, or null (the registry's lock held).
std::pair<const uintptr_t, Alloc>* holding(Allocs& A, uintptr_t at) {
    auto next = A.live.upper_bound(at);
    if (next == A.live.begin()) return nullptr;
    auto prev = std::prev(next);
    return at < prev->second.end ? &*prev : nullptr;
}

// Checks an access of [at, at + bytes) of global memory (`reads`: it reads
// them; `writes`: it writes them) against the live allocations: empty when it
// lies inside one and reads nothing unwritten (and then records what it
// writes), else what is wrong: "out of bounds: ... at byte <offset> of the
// <n>-byte allocation at <address>, ..." (a negative offset lies before its
// start; the nearest allocation) or "uninitialized: ...".
std::string check_global(uintptr_t at, size_t bytes, bool reads, bool writes) {
    Allocs& A = allocs();
    std::lock_guard<std::mutex> lock(A.mu);
    auto next = A.live.upper_bound(at);
    const bool has_prev = next != A.live.begin();
    const auto prev = has_prev ? std::prev(next) : A.live.end();
    auto of = [&](uintptr_t start, uintptr_t end, const char* how) {
        char buf[240];
        std::snprintf(buf, sizeof buf, "at byte %lld of the %llu-byte allocation at %#llx%s",
                      (long long)(at - start), (unsigned long long)(end - start),
                      (unsigned long long)start, how);
        return std::string(buf);
    };
    if (has_prev && at < prev->second.end) {
        Alloc& a = prev->second;
        if (at + bytes > a.end)
            return "out of bounds: " + of(prev->first, a.end, ", reaching past its end");
        if (reads)
            for (uintptr_t x = at - prev->first; x < at + bytes - prev->first; ++x)
                if (!(a.written[x >> 3] >> (x & 7) & 1u)) {
                    char buf[120];
                    std::snprintf(buf, sizeof buf,
                                  " (its byte %llu has not been written since the allocation)",
                                  (unsigned long long)x);
                    return "uninitialized: " + of(prev->first, a.end, buf);
                }
        if (writes) mark_written(a, prev->first, at, bytes);
        return "";
    }
    const unsigned long long after = has_prev ? at - prev->second.end : ~0ull;
    const unsigned long long before = next != A.live.end() ? next->first - at : ~0ull;
    std::string where =
        "out of bounds: " +
        (after == ~0ull && before == ~0ull
             ? std::string("in no live device allocation")
         : after <= before
             ? of(prev->first, prev->second.end, ", past its end (the nearest allocation)")
             : of(next->first, next->second.end, ", before its start (the nearest allocation)"));
    for (auto f = A.freed.rbegin(); f != A.freed.rend(); ++f)
        if (at >= f->first && at < f->second) {
            char buf[200];
            std::snprintf(buf, sizeof buf,
                          "; the address was byte %llu of the %llu-byte allocation at %#llx, "
                          "which has been freed",
                          (unsigned long long)(at - f->first),
                          (unsigned long long)(f->second - f->first),
                          (unsigned long long)f->first);
            where += buf;
            break;
        }
    return where;
}

void mem_fail(Launch* L, const Access& a, const std::string& what) {
    if (g.stop) return;
    g.stop = true;
    fail(L, std::string("memcheck: ") + what + ", by " + who(L, a.me) + function_of(a.pc));
}

std::string sized(const Access& a, size_t bytes, uintptr_t at) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s of %zu bytes at %#llx", a.what, bytes,
                  (unsigned long long)at);
    return buf;
}

// An access of `bytes` at `at` that reaches outside dynamic shared memory of
// block `b` (which the window [lo, lo + smem_bytes) is).
void outside_shared(Launch* L, const Access& a, unsigned b, uintptr_t at, size_t bytes,
                    uintptr_t lo) {
    char buf[240];
    std::snprintf(buf, sizeof buf,
                  "out of bounds: %s of %zu bytes at byte %lld of the dynamic shared memory of "
                  "cluster block %u, which has %zu bytes (the launch's dynamic shared memory size)",
                  a.what, bytes, (long long)(at - lo), b, L->smem_bytes);
    mem_fail(L, a, buf);
}

// Stops the running thread before the access that failed: its fiber returns
// to the scheduler, which runs nothing more of a launch that has failed.
void stop_thread(Launch* L) { to_scheduler(L); }

// Checks and records access `a` of [p, p + bytes): shared memory (dynamic,
// `__shared__`) and global memory (anything else kernel code reaches but the
// fibers' stacks and the runtime's state).
void visit(Launch* L, const void* p, size_t bytes, const Access& a) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    for (unsigned b = 0; b < L->ctas.size() && b < g.win.size(); ++b) {
        const Cta& cta = L->ctas[b];
        const uintptr_t lo = reinterpret_cast<uintptr_t>(cta.smem);
        const uintptr_t w_lo = reinterpret_cast<uintptr_t>(cta.dyn_smem.data());
        if (at + bytes <= w_lo || at >= w_lo + cta.dyn_smem.size()) continue;
        if (at < lo || at + bytes > lo + L->smem_bytes) {
            outside_shared(L, a, b, at, bytes, lo);
            return;
        }
        {
            const uintptr_t end = at + bytes;
            static const char* names[] = {"dynamic shared memory of cluster block 0",
                                          "dynamic shared memory of cluster block 1",
                                          "dynamic shared memory of cluster block 2",
                                          "dynamic shared memory of cluster block 3+"};
            const char* region = L->csize == 1 ? "dynamic shared memory" : names[b < 3 ? b : 3];
            for (uintptr_t x = at; x < end && !g.stop; ++x)
                access(L, g.win[b][x - lo], a, region, x - lo, x);
            return;
        }
    }
    if (at < g.st_hi && at + bytes > g.st_lo)
        for (auto& r : g.static_ranges)
            if (at >= r.first && at < r.second) {
                for (uintptr_t x = at; x < at + bytes && x < r.second && !g.stop; ++x)
                    access(L, g.statics[x], a, "a __shared__ variable", x - r.first, x);
                return;
            }
    if (skipped(at)) return;
    if (!L->strict) {
        // a raw launch (its addresses may be host memory): what it writes of a
        // registered allocation counts as written for later checked launches
        if (a.write) {
            Allocs& A = allocs();
            std::lock_guard<std::mutex> lock(A.mu);
            if (auto* h = holding(A, at)) mark_written(h->second, h->first, at, bytes);
        }
    } else {
        // an atomic (a bulk reduction's add too) reads what it updates
        const bool reads = !a.write || a.kind == ATOMIC;
        const std::string what = check_global(at, bytes, reads, a.write);
        if (!what.empty()) {
            const size_t colon = what.find(": ");
            mem_fail(L, a, what.substr(0, colon + 2) + sized(a, bytes, at) + " of global memory, " +
                               what.substr(colon + 2));
            return;
        }
    }
    for (uintptr_t x = at; x < at + bytes && !g.stop; ++x) global_access(L, x, a);
}

bool on(Launch* L) { return L && L->current && !g.stop && L->error.empty(); }

// An access of the running thread; `align` the alignment its type promises
// (1: none). A thread whose access fails a check, or that accesses memory once
// its launch has failed, stops before the access.
void thread_access(const void* p, size_t bytes, bool write, Kind kind, const void* pc,
                   size_t align = 1) {
    Launch* L = g_launch;
    if (!L || !L->current) return;
    if (!L->error.empty()) {
        stop_thread(L);
        return;
    }
    const unsigned t = fid(L, L->current);
    const Access a{Epoch{t, row(t)[t]}, row(t), kind, write,
                   kind == ATOMIC ? "an atomic" : write ? "a store" : "a load", pc};
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    if (align > 1 && at % align != 0) {
        char buf[120];
        std::snprintf(buf, sizeof buf, " (its type needs a %zu-byte aligned address)", align);
        mem_fail(L, a, "misaligned address: " + sized(a, bytes, at) + buf);
    } else {
        visit(L, p, bytes, a);
    }
    if (!L->error.empty()) stop_thread(L);
}

// An asynchronous operation of thread `t`: a new agent epoch, checked with
// what `vc` (its issuer's knowledge) holds.
Epoch agent_epoch(unsigned t) { return Epoch{g.n + t, ++g.agent[t]}; }

void async_access(Launch* L, Epoch e, const u32* vc, const void* p, size_t bytes, bool write,
                  const char* what, Kind kind = ASYNC) {
    if (!L || g.stop || !L->error.empty()) return;
    visit(L, p, bytes, Access{e, vc, kind, write, what, nullptr});
}

// A new launch: global memory starts unwritten.
void begin_launch() {
    g.global.clear();
    g.run = 0;
}

// Every thread of `fs` (a barrier's participants) acquires what all of them
// (and `also`, threads that exited) released.
template <typename It>
void barrier(It begin, It end, const std::vector<unsigned>& also = {}) {
    g.tmp.assign(g.V, 0);
    for (It i = begin; i != end; ++i) join(g.tmp.data(), row(*i));
    for (unsigned t : also) join(g.tmp.data(), row(t));
    for (It i = begin; i != end; ++i) {
        std::memcpy(row(*i), g.tmp.data(), sizeof(u32) * g.V);
        tick(*i);
    }
}

void mbar_release(Mbar* m, const u32* vc) {
    if (m->acc.size() != g.V) m->acc.assign(g.V, 0);
    join(m->acc.data(), vc);
}

// The phase of `m` has just completed (its parity is that of phase - 1).
void mbar_completed(Mbar* m) {
    if (m->acc.size() != g.V) m->acc.assign(g.V, 0);
    m->done[(m->phase - 1) & 1u] = m->acc;
    m->acc.assign(g.V, 0);
}

void mbar_acquire(Mbar* m, unsigned parity, unsigned t) {
    if (m->done[parity & 1u].size() == g.V) join(row(t), m->done[parity & 1u].data());
}

// Thread `t` learns that its agent's operations up to `clk` are done.
void agent_done(unsigned t, u32 clk) {
    u32& k = row(t)[g.n + t];
    k = k > clk ? k : clk;
}

template <typename V>
void retire(V& pending, int keep_from, unsigned t) {
    size_t k = 0;
    for (auto& p : pending) {
        if (p.first >= 0 && p.first < keep_from)
            agent_done(t, p.second);
        else
            pending[k++] = p;
    }
    pending.resize(k);
}

}  // namespace race

#define TPAR_RACE(stmt) \
    do {                \
        stmt;           \
    } while (0)
#else
#define TPAR_RACE(stmt) \
    do {                \
    } while (0)
#endif

void fiber_entry() {
    Launch* L = g_launch;
    L->kernel(L->args);
    L->current->state = DONE;
    // returning resumes the scheduler through uc_link (fast switch: the
    // caller, tpar_emu_fiber_main, switches back and is never resumed)
}

#ifdef TPAR_EMU_FAST_SWITCH
// A fiber's body: the kernel, then back to the scheduler for good.
extern "C" void tpar_emu_fiber_main() {
    fiber_entry();
    to_scheduler(g_launch);
    __builtin_trap();  // a finished fiber is never resumed
}
#endif

// Yields from the running fiber back to the scheduler.
void yield_to_scheduler() { to_scheduler(g_launch); }

// ---------------------------------------------------------------- faults
//
// A GPU reports a kernel's bad access as the launch's error (a misaligned or
// an illegal address) and the host program goes on. Kernel code here runs on
// the host, where the same access raises SIGSEGV or SIGBUS and would end the
// process (and so would an integer division by zero, SIGFPE, which a GPU
// answers with an unspecified value). While a launch runs, on_fault catches
// such a fault of its running fiber: it records the fault and switches to the
// scheduler, which fails the launch naming the thread and where it was, and
// never resumes that fiber. Any other fault goes to the handler installed
// before (the process ends as it would have). The handler runs on the
// thread's alternate signal stack where it has one (Rust's threads do), so a
// fiber's overflowed stack can be reported too.

// The launch in progress and the thread running it (one at a time: g_mutex).
std::atomic<Launch*> g_running{nullptr};
pthread_t g_runner;
struct sigaction g_prev_segv, g_prev_bus, g_prev_fpe;

const void* fault_pc(const void* uc) {
    const ucontext_t* u = static_cast<const ucontext_t*>(uc);
#if defined(__x86_64__)
    return reinterpret_cast<const void*>(u->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
    return reinterpret_cast<const void*>(u->uc_mcontext.pc);
#else
    (void)u;
    return nullptr;
#endif
}

void on_fault(int sig, siginfo_t* info, void* uc) {
    Launch* L = g_running.load(std::memory_order_acquire);
    if (L && pthread_equal(pthread_self(), g_runner) && L->current && L->fault.signo == 0) {
        L->fault.signo = sig;
        L->fault.code = info->si_code;
        L->fault.addr = info->si_addr;
        L->fault.pc = fault_pc(uc);
        to_scheduler(L);  // never resumed
        __builtin_trap();
    }
    const struct sigaction& prev =
        sig == SIGBUS ? g_prev_bus : (sig == SIGFPE ? g_prev_fpe : g_prev_segv);
    if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction) {
        prev.sa_sigaction(sig, info, uc);
    } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
        prev.sa_handler(sig);
    } else {
        // returning re-runs the access, which faults again under the default
        signal(sig, SIG_DFL);
    }
}

// Installs on_fault once (called under g_mutex).
void install_fault_handler() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: the handler never returns to the faulting fiber, so the
    // signal must not stay blocked on this thread afterwards
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
    sigaction(SIGFPE, &sa, &g_prev_fpe);
}

// The launch error for the fault of fiber `f` that on_fault recorded.
std::string fault_report(Launch* L, const Fiber& f) {
    const auto& x = L->fault;
    const uintptr_t at = reinterpret_cast<uintptr_t>(x.addr);
    const uintptr_t base = reinterpret_cast<uintptr_t>(g_stacks[&f - L->fibers.data()]);
    char buf[320];
    if (x.signo == SIGSEGV && at >= base - kGuard && at < base) {
        std::snprintf(buf, sizeof buf,
                      "the thread's stack overflowed (the emulator gives each thread %zu KiB: "
                      "local arrays or recursion too deep)",
                      kStack / 1024);
    } else if (x.signo == SIGSEGV && x.code == SI_KERNEL) {
        std::snprintf(buf, sizeof buf,
                      "a general-protection fault (on x86-64: an aligned vector access, such as "
                      "a 16-byte load or store, at an address that is not a multiple of its "
                      "size, which a GPU reports as a misaligned address; or a non-canonical "
                      "address)");
    } else if (x.signo == SIGSEGV) {
        std::snprintf(buf, sizeof buf,
                      "an illegal address: an access at %#llx, where the host maps %s",
                      (unsigned long long)at,
                      x.code == SEGV_ACCERR ? "memory without that access" : "nothing");
    } else if (x.signo == SIGFPE) {
        std::snprintf(buf, sizeof buf,
                      "an arithmetic fault (%s; a GPU gives an unspecified value instead)",
                      x.code == FPE_INTDIV ? "an integer division by zero"
                                           : "an integer division that overflows");
    } else {
        std::snprintf(buf, sizeof buf, "a bus error at %#llx%s", (unsigned long long)at,
                      x.code == BUS_ADRALN ? " (a misaligned address)" : "");
    }
    std::string report = std::string("fault: ") + buf + ", by " + where(&f) + function_of(x.pc);
#ifndef TPAR_EMU_RACECHECK
    report += " (the memcheck, TPAR_EMU_RACECHECK=1, names a bad access before it is made)";
#endif
    return report;
}

// Completes the warp operation all live lanes of `w` have arrived at.
void complete_warp(Warp& w) {
    void* ins[32] = {};
    void* outs[32] = {};
    for (int l = 0; l < 32; ++l) {
        Fiber* f = w.lanes[l];
        if (f && f->state == AT_WARP) {
            ins[l] = f->in;
            outs[l] = f->out;
        }
    }
    // A lane without data (e.g. __syncwarp) passes null: give combine a dummy.
    w.combine(ins, outs, w.kind);
#ifdef TPAR_EMU_RACECHECK
    // __syncwarp (no lane passes data) orders its lanes' memory accesses;
    // shuffles, votes, mma and ldmatrix order nothing
    {
        std::vector<unsigned> ids;
        bool sync = true;
        for (int l = 0; l < 32; ++l) {
            Fiber* f = w.lanes[l];
            if (f && f->state == AT_WARP) {
                sync = sync && !f->in && !f->out;
                ids.push_back(race::fid(g_launch, f));
            }
        }
        if (sync) race::barrier(ids.begin(), ids.end());
    }
#endif
    for (int l = 0; l < 32; ++l) {
        Fiber* f = w.lanes[l];
        if (f && f->state == AT_WARP) f->state = RUNNABLE;
    }
    w.arrived = 0;
    w.combine = nullptr;
}

// Completes the warpgroup collective all live threads of `g` have arrived at.
void complete_group(Group& g) {
    void* ins[128] = {};
    void* outs[128] = {};
    for (int t = 0; t < 128; ++t) {
        Fiber* f = g.threads[t];
        if (f && f->state == AT_GROUP) {
            ins[t] = f->in;
            outs[t] = f->out;
        }
    }
    g.combine(ins, outs, g.kind);
    for (int t = 0; t < 128; ++t) {
        Fiber* f = g.threads[t];
        if (f && f->state == AT_GROUP) f->state = RUNNABLE;
    }
    g.arrived = 0;
    g.combine = nullptr;
}

bool mbar_ready(Launch* L, const Fiber& f) {
    auto it = L->mbars.find(f.mbar);
    // an invalidated barrier never completes the wait
    return it != L->mbars.end() && (it->second.phase & 1u) != f.parity;
}

// Runs the blocks of one cluster (one block without clusters) together.
void run_cluster(Launch* L) {
    const unsigned per_block = L->block.x * L->block.y * L->block.z;
    const unsigned nthreads = per_block * L->csize;
    const unsigned nwarps = (nthreads + 31) / 32;
    const unsigned groups_per_block = (per_block + 127) / 128;
    L->fibers.assign(nthreads, Fiber{});
    L->warps.assign(nwarps, Warp{});
    L->groups.assign(groups_per_block * L->csize, Group{});
    L->mbars.clear();
    for (Cta& c : L->ctas) {
        c.live = per_block;
        c.reg_pool = 0;
    }
    const unsigned regs0 = entry_registers(per_block);
    while (g_stacks.size() < nthreads) {
        void* p = mmap(nullptr, kGuard + kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED || mprotect(p, kGuard, PROT_NONE) != 0) {
            if (p != MAP_FAILED) munmap(p, kGuard + kStack);
            fail(L, "could not map fiber stacks");
            return;
        }
        g_stacks.push_back(static_cast<char*>(p) + kGuard);
    }
    for (unsigned i = 0; i < nthreads; ++i) {
        Fiber& f = L->fibers[i];
        const unsigned j = i % per_block;
        f.cta = i / per_block;
        f.local = j;
        f.tid = dim3{j % L->block.x, (j / L->block.x) % L->block.y, j / (L->block.x * L->block.y)};
        f.lane = i % 32;
        f.warp = i / 32;
        f.group = f.cta * groups_per_block + j / 128;
        f.regs = regs0;
        L->warps[f.warp].lanes[f.lane] = &f;
        L->warps[f.warp].live++;
        L->groups[f.group].threads[j % 128] = &f;
        L->groups[f.group].live++;
#ifdef TPAR_EMU_FAST_SWITCH
        {
            // the frame tpar_emu_switch restores, at the stack's top: the
            // scheduler's SSE and x87 control words, six zeroed registers,
            // then tpar_emu_fiber_start as the return address
            uint64_t* sp = reinterpret_cast<uint64_t*>(g_stacks[i] + kStack) - 8;
            uint32_t mxcsr;
            uint16_t fpucw;
            asm volatile("stmxcsr %0" : "=m"(mxcsr));
            asm volatile("fnstcw %0" : "=m"(fpucw));
            sp[0] = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
            for (int r = 1; r <= 6; ++r) sp[r] = 0;
            sp[7] = (uint64_t)(uintptr_t)&tpar_emu_fiber_start;
            f.sp = sp;
        }
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[i];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &L->sched;
        makecontext(&f.ctx, fiber_entry, 0);
#endif
    }
    TPAR_RACE(race::begin_cluster(L));
    // Warps run one at a time in a shuffled order, each until all its lanes
    // wait at a barrier or have exited; lanes of a warp run in a shuffled
    // order. A warp thus
    // runs ahead of the others up to the next barrier, which exposes a
    // missing __syncthreads between a write and another warp's read.
    std::vector<unsigned> worder(nwarps), lorder(32);
    for (unsigned i = 0; i < nwarps; ++i) worder[i] = i;
    for (unsigned i = 0; i < 32; ++i) lorder[i] = i;
    auto shuffle = [&](std::vector<unsigned>& v) {
        for (size_t i = v.size(); i > 1; --i) {
            unsigned j = (unsigned)(next_rand(L) % i);
            unsigned t = v[i - 1];
            v[i - 1] = v[j];
            v[j] = t;
        }
    };
    unsigned live = nthreads;
    while (live > 0 && L->error.empty()) {
        shuffle(worder);
        bool ran = false;
        for (unsigned wi = 0; wi < nwarps && L->error.empty(); ++wi) {
            const unsigned w = worder[wi];
            bool progress = true;
            while (progress && L->error.empty()) {
                progress = false;
                shuffle(lorder);
                for (unsigned li = 0; li < 32 && L->error.empty(); ++li) {
                    const unsigned t = w * 32 + lorder[li];
                    if (t >= nthreads) continue;
                    Fiber& f = L->fibers[t];
                    if (f.state == AT_MBAR && mbar_ready(L, f)) f.state = RUNNABLE;
                    if (f.state == AT_REGS && L->ctas[f.cta].reg_pool >= f.reg_need)
                        f.state = RUNNABLE;
                    if (f.state != RUNNABLE) continue;
                    ran = progress = true;
                    L->current = &f;
                    to_fiber(L, f);
                    L->current = nullptr;
                    if (L->fault.signo != 0) {
                        fail(L, fault_report(L, f));
                        break;
                    }
                    if (f.state == DONE) {
                        --live;
                        L->ctas[f.cta].live--;
                        if (!f.wgmma.empty())
                            fail(L, "a thread exited with wgmma.mma_async results it never "
                                    "waited for (wgmma.commit_group / wgmma.wait_group missing) "
                                    "at " + where(&f));
                        if (!f.bulk.empty())
                            fail(L, "a thread exited with bulk asynchronous reductions "
                                    "(cp.reduce.async.bulk) it never waited for "
                                    "(cp.async.bulk.commit_group / wait_group missing) at " +
                                        where(&f));
                        Warp& wp = L->warps[f.warp];
                        wp.live--;
                        if (wp.arrived > 0 && wp.arrived == wp.live) complete_warp(wp);
                        Group& gp = L->groups[f.group];
                        gp.live--;
                        if (gp.arrived > 0 && gp.arrived == gp.live) complete_group(gp);
                    }
                }
            }
        }
        if (ran || live == 0 || !L->error.empty()) continue;
        // __syncthreads completes for each block whose live threads all wait
        // there; the cluster barrier once every live thread of the cluster waits
        // at it
        unsigned at_barrier = 0, at_cluster = 0;
        bool released = false;
        for (unsigned b = 0; b < L->csize; ++b) {
            unsigned lb = 0, ab = 0;
            for (unsigned i = b * per_block; i < (b + 1) * per_block; ++i) {
                lb += L->fibers[i].state != DONE;
                ab += L->fibers[i].state == AT_BARRIER;
            }
            at_barrier += ab;
            if (ab > 0 && ab == lb) {
#ifdef TPAR_EMU_RACECHECK
                std::vector<unsigned> ids, exited;
                for (unsigned i = b * per_block; i < (b + 1) * per_block; ++i)
                    (L->fibers[i].state == AT_BARRIER ? ids : exited).push_back(i);
                race::barrier(ids.begin(), ids.end(), exited);
#endif
                for (unsigned i = b * per_block; i < (b + 1) * per_block; ++i)
                    if (L->fibers[i].state == AT_BARRIER) L->fibers[i].state = RUNNABLE;
                released = true;
            }
        }
        for (auto& f : L->fibers) at_cluster += f.state == AT_CLUSTER;
        if (at_cluster > 0 && at_cluster == live) {
#ifdef TPAR_EMU_RACECHECK
            std::vector<unsigned> ids, exited;
            for (unsigned i = 0; i < nthreads; ++i)
                (L->fibers[i].state == AT_CLUSTER ? ids : exited).push_back(i);
            race::barrier(ids.begin(), ids.end(), exited);
#endif
            for (auto& f : L->fibers)
                if (f.state == AT_CLUSTER) f.state = RUNNABLE;
            released = true;
        }
        if (released) continue;
        // Nothing can run: describe who waits where.
        unsigned at_mbar = 0, at_group = 0, at_regs = 0;
        for (auto& f : L->fibers) {
            at_mbar += f.state == AT_MBAR;
            at_group += f.state == AT_GROUP;
            at_regs += f.state == AT_REGS;
        }
        std::string msg = "deadlock: ";
        char buf[400];
        if (at_cluster > 0) {
            std::snprintf(buf, sizeof buf, "%u threads wait at the cluster barrier; ", at_cluster);
            msg += buf;
        }
        if (at_regs > 0) {
            const Fiber* w = nullptr;
            for (auto& f : L->fibers)
                if (f.state == AT_REGS && !w) w = &f;
            std::snprintf(buf, sizeof buf,
                          "%u threads wait at setmaxnreg.inc for registers their block does not "
                          "have (the first, at %s, asks for %u more per thread; %llu are free in "
                          "its block's pool; each thread held %u at entry: the warpgroups' "
                          "setmaxnreg counts must fit in that many per thread, summed); ",
                          at_regs, where(w).c_str(), w->reg_need, L->ctas[w->cta].reg_pool,
                          regs0);
            msg += buf;
        }
        std::snprintf(buf, sizeof buf,
                      "%u of %u live threads wait at __syncthreads, %u at mbarrier phases that "
                      "never complete, %u at warpgroup operations and %u at warp operations "
                      "some threads of their warp or warpgroup never reach (",
                      at_barrier, live, at_mbar, at_group,
                      live - at_barrier - at_mbar - at_group - at_cluster - at_regs);
        msg += buf;
        int shown = 0;
        for (auto& f : L->fibers) {
            if (f.state != AT_WARP && f.state != AT_GROUP && f.state != AT_MBAR) continue;
            if (shown >= 3) break;
            msg += (shown ? ", " : "") + where(&f);
            if (f.state == AT_MBAR) {
                auto it = L->mbars.find(f.mbar);
                if (it == L->mbars.end()) {
                    msg += " on an invalidated mbarrier";
                } else {
                    std::snprintf(buf, sizeof buf,
                                  " on an mbarrier waiting for parity %u (phase %u, %u arrivals "
                                  "and %lld transaction bytes pending)",
                                  f.parity, it->second.phase, it->second.pending, it->second.tx);
                    msg += buf;
                }
            } else if (f.state == AT_GROUP) {
                msg += " at a warpgroup operation";
            }
            ++shown;
        }
        msg += ")";
        fail(L, msg);
    }
}

}  // namespace

extern "C" {

const dim3* tpar_emu_thread_idx() { return &g_launch->current->tid; }
const dim3* tpar_emu_block_idx() { return &g_launch->ctas[g_launch->current->cta].bidx; }
const dim3* tpar_emu_block_dim() { return &g_launch->block; }
const dim3* tpar_emu_grid_dim() { return &g_launch->grid; }
unsigned char* tpar_emu_dyn_smem_ptr() { return cur_smem(g_launch); }

void tpar_emu_fail(const char* what) {
    Launch* L = g_launch;
    if (L->current)
        fail(L, std::string(what) + " at " + where(L->current));
    else
        fail(L, what);
}

void tpar_emu_syncthreads() {
    Launch* L = g_launch;
    L->current->state = AT_BARRIER;
    yield_to_scheduler();
}

void tpar_emu_warp_collective(void* in, void* out, tpar_emu_combine_fn combine, int kind) {
    Launch* L = g_launch;
    Fiber* f = L->current;
    Warp& w = L->warps[f->warp];
    if (w.arrived > 0 && (w.combine != combine || w.kind != kind)) {
        tpar_emu_fail("lanes of one warp are at different warp operations");
        return;
    }
    w.combine = combine;
    w.kind = kind;
    f->in = in;
    f->out = out;
    f->state = AT_WARP;
    w.arrived++;
    if (w.arrived == w.live) {
        complete_warp(w);
        return;  // the completing lane runs on
    }
    yield_to_scheduler();
}

namespace {
struct MmaIn {
    u32 a[4];
    u32 b[2];
    float c[4];
};

float half_bits_to_f32(u16 v, int f16) {
    return f16 ? tpar_emu_f16_to_f32(v) : __uint_as_float(((u32)v) << 16);
}

void mma_combine(void* const* ins, void* const* outs, int f16) {
    float A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        if (!ins[lane]) {
            tpar_emu_fail("mma.sync with a lane that has exited");
            return;
        }
        const MmaIn* m = static_cast<const MmaIn*>(ins[lane]);
        int g = lane / 4, t = lane % 4;
        auto lo = [&](u32 r) { return half_bits_to_f32((u16)(r & 0xffffu), f16); };
        auto hi = [&](u32 r) { return half_bits_to_f32((u16)(r >> 16), f16); };
        A[g][2 * t] = lo(m->a[0]);
        A[g][2 * t + 1] = hi(m->a[0]);
        A[g + 8][2 * t] = lo(m->a[1]);
        A[g + 8][2 * t + 1] = hi(m->a[1]);
        A[g][2 * t + 8] = lo(m->a[2]);
        A[g][2 * t + 9] = hi(m->a[2]);
        A[g + 8][2 * t + 8] = lo(m->a[3]);
        A[g + 8][2 * t + 9] = hi(m->a[3]);
        B[2 * t][g] = lo(m->b[0]);
        B[2 * t + 1][g] = hi(m->b[0]);
        B[2 * t + 8][g] = lo(m->b[1]);
        B[2 * t + 9][g] = hi(m->b[1]);
        C[g][2 * t] = m->c[0];
        C[g][2 * t + 1] = m->c[1];
        C[g + 8][2 * t] = m->c[2];
        C[g + 8][2 * t + 1] = m->c[3];
    }
    float D[16][8];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            float s = 0.0f;
            for (int k = 0; k < 16; ++k) s += A[i][k] * B[k][j];
            D[i][j] = C[i][j] + s;
        }
    for (int lane = 0; lane < 32; ++lane) {
        float* d = static_cast<float*>(outs[lane]);
        int g = lane / 4, t = lane % 4;
        d[0] = D[g][2 * t];
        d[1] = D[g][2 * t + 1];
        d[2] = D[g + 8][2 * t];
        d[3] = D[g + 8][2 * t + 1];
    }
}

struct LdmIn {
    const void* row;
};

void ldmatrix_combine(void* const* ins, void* const* outs, int kind) {
    const int count = kind & 7;
    const bool trans = (kind & 8) != 0;
    u16 M[4][8][8];
    for (int i = 0; i < count; ++i) {
        for (int r = 0; r < 8; ++r) {
            const int lane = 8 * i + r;
            if (!ins[lane]) {
                tpar_emu_fail("ldmatrix with a lane that has exited");
                return;
            }
            const void* p = static_cast<const LdmIn*>(ins[lane])->row;
            if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
                tpar_emu_fail("ldmatrix row address not 16-byte aligned");
                return;
            }
            std::memcpy(M[i][r], p, 16);
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        if (!outs[lane]) continue;
        u32* r = static_cast<u32*>(outs[lane]);
        int g = lane / 4, t = lane % 4;
        for (int i = 0; i < count; ++i) {
            u16 lo = trans ? M[i][2 * t][g] : M[i][g][2 * t];
            u16 hi = trans ? M[i][2 * t + 1][g] : M[i][g][2 * t + 1];
            r[i] = (u32)lo | ((u32)hi << 16);
        }
    }
}
}  // namespace

void tpar_emu_mma_16816(float d[4], const u32 a[4], const u32 b[2], int f16) {
    MmaIn in;
    std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(in.b, b, sizeof in.b);
    std::memcpy(in.c, d, sizeof in.c);
    float out[4] = {d[0], d[1], d[2], d[3]};
    tpar_emu_warp_collective(&in, out, &mma_combine, f16);
    std::memcpy(d, out, sizeof out);
}

void tpar_emu_ldmatrix(u32* r, const void* row, int count, bool trans) {
    TPAR_RACE(if (g_launch->current->lane < 8 * count) race::thread_access(
                  row, 16, false, race::GENERIC, __builtin_return_address(0)));
    LdmIn in{row};
    u32 out[4] = {};
    tpar_emu_warp_collective(&in, out, &ldmatrix_combine, count | (trans ? 8 : 0));
    for (int i = 0; i < count; ++i) r[i] = out[i];
}

void tpar_emu_cp_async_16(void* smem, const void* gmem, bool pred) {
    if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 ||
        (pred && reinterpret_cast<uintptr_t>(gmem) % 16 != 0)) {
        tpar_emu_fail("cp.async of 16 bytes with an address not 16-byte aligned");
        return;
    }
#ifdef TPAR_EMU_RACECHECK
    Launch* L = g_launch;
    if (race::on(L)) {
        const unsigned t = race::fid(L, L->current);
        const race::Epoch e = race::agent_epoch(t);
        if (pred) race::async_access(L, e, race::row(t), gmem, 16, false, "a cp.async read");
        race::async_access(L, e, race::row(t), smem, 16, true, "a cp.async write");
        if (!L->error.empty()) return;  // memcheck: not copied
        L->current->race_cpa.push_back({-1, e.clk});
    }
#endif
    if (pred)
        std::memcpy(smem, gmem, 16);
    else
        std::memset(smem, 0, 16);
}

// cp.async.commit_group: closes the thread's open cp.async group.
void tpar_emu_cp_async_commit() {
    Fiber* f = g_launch->current;
    for (auto& p : f->race_cpa)
        if (p.first < 0) p.first = f->cpa_groups;
    f->cpa_groups++;
}

// cp.async.wait_group n: all but the newest n committed groups are done.
void tpar_emu_cp_async_wait(int n) {
    Fiber* f = g_launch->current;
    TPAR_RACE(race::retire(f->race_cpa, f->cpa_groups - n, race::fid(g_launch, f)));
    (void)f;
    (void)n;
}

// fence.proxy.async: the thread's earlier ordinary stores to shared memory
// become visible to asynchronous operations ordered after the fence.
void tpar_emu_fence_proxy_async() {
#ifdef TPAR_EMU_RACECHECK
    Launch* L = g_launch;
    if (race::on(L)) {
        const unsigned t = race::fid(L, L->current);
        race::g.fences[t].push_back(race::row(t)[t]);
        race::tick(t);
    }
#endif
}

// An atomic read-modify-write of `bytes` at `p` by the running thread
// (racecheck: atomics do not race with each other).
void tpar_emu_race_atomic(const void* p, unsigned bytes) {
    TPAR_RACE(race::thread_access(p, bytes, true, race::ATOMIC, __builtin_return_address(0),
                                  bytes));
    (void)p;
    (void)bytes;
}

// ---------------------------------------------------------------- Hopper (sm_90a)

void tpar_emu_warpgroup_collective(void* in, void* out, tpar_emu_combine_fn combine, int kind) {
    Launch* L = g_launch;
    Fiber* f = L->current;
    const unsigned per_block = L->block.x * L->block.y * L->block.z;
    if ((f->local / 128 + 1) * 128 > per_block) {
        tpar_emu_fail("a warpgroup operation in a block whose threads do not fill whole "
                      "warpgroups of 128");
        return;
    }
    Group& g = L->groups[f->group];
    if (g.arrived > 0 && (g.combine != combine || g.kind != kind)) {
        tpar_emu_fail("threads of one warpgroup are at different warpgroup operations");
        return;
    }
    g.combine = combine;
    g.kind = kind;
    f->in = in;
    f->out = out;
    f->state = AT_GROUP;
    g.arrived++;
    if (g.arrived == g.live) {
        complete_group(g);
        return;
    }
    yield_to_scheduler();
}

unsigned tpar_emu_smem_offset(const void* p) {
    Launch* L = g_launch;
    const unsigned char* c = static_cast<const unsigned char*>(p);
    const unsigned char* smem = cur_smem(L);
    if (c < smem || c > smem + L->smem_bytes) {
        tpar_emu_fail("a shared-memory address that is not in its block's dynamic shared memory "
                      "(the emulator's shared window is tpar_dyn_smem)");
        return 0;
    }
    return (unsigned)(c - smem);
}

namespace {
Mbar* find_mbar(const void* bar, const char* op) {
    Launch* L = g_launch;
    auto it = L->mbars.find(bar);
    if (it == L->mbars.end()) {
        tpar_emu_fail((std::string(op) + " on an mbarrier that was never initialized (or was "
                                         "invalidated)")
                          .c_str());
        return nullptr;
    }
    return &it->second;
}

void mbar_check_phase(Mbar* m) {
    if (m->pending == 0 && m->tx == 0) {
        m->phase++;
        m->pending = m->expected;
        TPAR_RACE(race::mbar_completed(m));
    }
}

void mbar_complete_tx(const void* bar, long long bytes) {
    Mbar* m = find_mbar(bar, "complete_tx of a bulk copy");
    if (!m) return;
    m->tx -= bytes;
    if (m->tx < -((1ll << 20) - 1)) {
        tpar_emu_fail("mbarrier transaction count below -(2^20 - 1)");
        return;
    }
    mbar_check_phase(m);
}
}  // namespace

void tpar_emu_mbar_init(void* bar, unsigned count) {
    if (reinterpret_cast<uintptr_t>(bar) % 8 != 0) {
        tpar_emu_fail("mbarrier not 8-byte aligned");
        return;
    }
    if (count == 0 || count >= (1u << 20)) {
        tpar_emu_fail("mbarrier.init with an expected arrival count outside 1..2^20-1");
        return;
    }
    Mbar m;
    m.expected = m.pending = count;
#ifdef TPAR_EMU_RACECHECK
    m.acc.assign(race::g.V, 0);
    m.done[0].assign(race::g.V, 0);
    m.done[1].assign(race::g.V, 0);
#endif
    g_launch->mbars[bar] = m;
    std::memset(bar, 0, 8);
}

void tpar_emu_mbar_inval(void* bar) {
    if (find_mbar(bar, "mbarrier.inval")) g_launch->mbars.erase(bar);
}

u64 tpar_emu_mbar_arrive(void* bar, unsigned count, unsigned tx) {
    Mbar* m = find_mbar(bar, "mbarrier.arrive");
    if (!m) return 0;
    const u64 token = m->phase;
    if (tx >= (1u << 20)) {
        tpar_emu_fail("mbarrier expect_tx of 2^20 bytes or more");
        return token;
    }
    m->tx += tx;
    if (count == 0 || count > m->pending) {
        tpar_emu_fail("mbarrier.arrive with more arrivals than the current phase still expects");
        return token;
    }
#ifdef TPAR_EMU_RACECHECK
    if (race::on(g_launch)) {
        const unsigned t = race::fid(g_launch, g_launch->current);
        race::mbar_release(m, race::row(t));
        race::tick(t);
    }
#endif
    m->pending -= count;
    mbar_check_phase(m);
    return token;
}

void tpar_emu_mbar_expect_tx(void* bar, unsigned tx) {
    Mbar* m = find_mbar(bar, "mbarrier.expect_tx");
    if (!m) return;
    if (tx >= (1u << 20)) {
        tpar_emu_fail("mbarrier expect_tx of 2^20 bytes or more");
        return;
    }
    m->tx += tx;
}

int tpar_emu_mbar_try_wait(void* bar, unsigned parity) {
    Launch* L = g_launch;
    if (!find_mbar(bar, "mbarrier.try_wait.parity")) return 1;
    Fiber* f = L->current;
    f->mbar = bar;
    f->parity = parity & 1u;
    if (!mbar_ready(L, *f)) {
        f->state = AT_MBAR;
        yield_to_scheduler();
    }
#ifdef TPAR_EMU_RACECHECK
    if (race::on(L)) {
        auto it = L->mbars.find(bar);
        if (it != L->mbars.end()) race::mbar_acquire(&it->second, parity, race::fid(L, f));
    }
#endif
    return 1;
}

// setmaxnreg (PTX ISA): .dec returns the thread's registers above `regs` to
// its block's pool; .inc waits until the pool holds the registers it adds,
// then takes them. A block starts with every register given to its threads
// (entry_registers) and an empty pool, so the warpgroups' counts must fit in
// what the block was launched with, or .inc waits forever (on a GPU too).
// Counted per thread: the sums are those of the ISA's per-warp accounting.
void tpar_emu_setmaxnreg(unsigned regs, int inc) {
    if (regs % 8 != 0 || regs < 24 || regs > 256) {
        tpar_emu_fail("setmaxnreg with a register count that is not a multiple of 8 in 24..256");
        return;
    }
    Launch* L = g_launch;
    Fiber* f = L->current;
    Cta& c = L->ctas[f->cta];
    if (inc ? regs < f->regs : regs > f->regs) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "setmaxnreg.%s to %u registers from %u",
                      inc ? "inc" : "dec", regs, f->regs);
        tpar_emu_fail(buf);
        return;
    }
    if (!inc) {
        c.reg_pool += f->regs - regs;
        f->regs = regs;
        return;
    }
    const unsigned need = regs - f->regs;
    while (c.reg_pool < need) {
        // resumed by the scheduler once the pool holds `need`
        f->reg_need = need;
        f->state = AT_REGS;
        yield_to_scheduler();
    }
    c.reg_pool -= need;
    f->regs = regs;
    f->reg_need = 0;
}

// ---------------------------------------------------------------- clusters

unsigned tpar_emu_cluster_ctarank() { return g_launch->current->cta; }
unsigned tpar_emu_cluster_nctarank() { return g_launch->csize; }

void tpar_emu_cluster_sync() {
    Launch* L = g_launch;
    L->current->state = AT_CLUSTER;
    yield_to_scheduler();
}

void* tpar_emu_mapa(const void* p, unsigned rank) {
    Launch* L = g_launch;
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (rank >= L->csize) {
        tpar_emu_fail("mapa to a block rank outside the cluster");
        return const_cast<void*>(p);
    }
    for (const Cta& cta : L->ctas)
        if (c >= cta.smem && c <= cta.smem + L->smem_bytes) {
            if (L->ctas[rank].live == 0) {
                // a remote arrival, multicast copy or load into a block whose
                // threads have all exited (on a GPU its shared memory may
                // belong to another block by then)
                tpar_emu_fail("an access to the shared memory of a block of the cluster whose "
                              "threads have all exited (a cluster_sync before exiting keeps "
                              "every block's shared memory alive while its peers use it)");
                return const_cast<void*>(p);
            }
            return L->ctas[rank].smem + (c - cta.smem);
        }
    tpar_emu_fail("mapa of an address outside dynamic shared memory (the emulator maps only "
                  "tpar_dyn_smem between the blocks of a cluster)");
    return const_cast<void*>(p);
}

// ---------------------------------------------------------------- tensor maps (TMA)

namespace {
// The emulated CUtensorMap, as src/cuda/tensor_map.rs encodes it (byte
// offsets): 0 magic "TPTM" (u32), 4 data type (CUtensorMapDataType), 5 rank,
// 6 element bytes, 7 swizzle (CUtensorMapSwizzle), 8 interleave (0), 9
// out-of-bounds fill (0: zeros), 16 global address (u64), 24 dims (u64 x 5,
// innermost first), 64 strides in bytes of dims 1.. (u64 x 4), 96 box sizes
// (u16 x 5), 106 element strides (u8 x 5).
constexpr u32 kMapMagic = 0x4d545054u;  // "TPTM"
struct MapView {
    unsigned dtype, rank, esize, swizzle, interleave, fill;
    u64 global;
    u64 dims[5];
    u64 strides[5];  // bytes; strides[0] = element size
    unsigned box[5];
    unsigned estride[5];
};

bool decode_map(const void* map, MapView* v) {
    const unsigned char* b = static_cast<const unsigned char*>(map);
    u32 magic;
    std::memcpy(&magic, b, 4);
    if (magic != kMapMagic) {
        tpar_emu_fail("a bulk tensor copy with a tensor map the emulator did not encode (use "
                      "the emulated cuTensorMapEncodeTiled of tpar_kernels::cuda::tensor_map)");
        return false;
    }
    v->dtype = b[4];
    v->rank = b[5];
    v->esize = b[6];
    v->swizzle = b[7];
    v->interleave = b[8];
    v->fill = b[9];
    std::memcpy(&v->global, b + 16, 8);
    for (unsigned i = 0; i < 5; ++i) {
        std::memcpy(&v->dims[i], b + 24 + 8 * i, 8);
        u16 bx;
        std::memcpy(&bx, b + 96 + 2 * i, 2);
        v->box[i] = bx;
        v->estride[i] = b[106 + i];
    }
    v->strides[0] = v->esize;
    for (unsigned i = 0; i < 4; ++i) std::memcpy(&v->strides[i + 1], b + 64 + 8 * i, 8);
    if (v->rank < 1 || v->rank > 5 || v->interleave != 0 || v->fill != 0) {
        tpar_emu_fail("a tensor map with a rank, interleave or fill the emulator does not model");
        return false;
    }
    for (unsigned i = 0; i < v->rank; ++i)
        if (v->estride[i] != 1 || v->box[i] == 0) {
            tpar_emu_fail("a tensor map with element strides other than 1 or an empty box");
            return false;
        }
    return true;
}

// The byte address a TMA box byte at `addr` lands at under `swizzle`
// (CU_TENSOR_MAP_SWIZZLE_*: 1 = 32B, 2 = 64B, 3 = 128B): bits 4.. of the
// address XOR bits 7.. (1, 2 or 3 of them), the shared-memory address being
// the one the pattern repeats on.
uintptr_t tma_swizzle(uintptr_t addr, unsigned swizzle) {
    if (swizzle == 0) return addr;
    const uintptr_t mask = (1u << swizzle) - 1;
    return addr ^ (((addr >> 7) & mask) << 4);
}

// Visits every element of the box at `coords`: f(smem byte offset before
// swizzling, global address or 0 when out of bounds).
extern "C++" template <typename F>
bool for_each_box_element(const MapView& v, const int* coords, int rank, F&& f) {
    if ((unsigned)rank != v.rank) {
        tpar_emu_fail("a bulk tensor copy of another rank than its tensor map's");
        return false;
    }
    unsigned long long total = 1;
    for (unsigned i = 0; i < v.rank; ++i) total *= v.box[i];
    for (unsigned long long e = 0; e < total; ++e) {
        unsigned long long rest = e;
        bool in = true;
        u64 addr = v.global;
        for (unsigned i = 0; i < v.rank; ++i) {
            const long long c = (long long)coords[i] + (long long)(rest % v.box[i]);
            rest /= v.box[i];
            if (c < 0 || (u64)c >= v.dims[i]) in = false;
            else addr += (u64)c * v.strides[i];
        }
        f(e * v.esize, in ? addr : 0);
    }
    return true;
}

bool check_smem_box(const void* smem, const MapView& v, const char* op) {
    Launch* L = g_launch;
    const unsigned char* c = static_cast<const unsigned char*>(smem);
    unsigned long long bytes = v.esize;
    for (unsigned i = 0; i < v.rank; ++i) bytes *= v.box[i];
    if (reinterpret_cast<uintptr_t>(smem) % 128 != 0) {
        tpar_emu_fail((std::string(op) + ": shared-memory box address not 128-byte aligned").c_str());
        return false;
    }
    const unsigned char* base = nullptr;
    for (const Cta& cta : L->ctas)
        if (c >= cta.smem && c + bytes <= cta.smem + L->smem_bytes) base = cta.smem;
    if (!base) {
        tpar_emu_fail((std::string(op) + ": the box does not fit in dynamic shared memory").c_str());
        return false;
    }
    return true;
}
}  // namespace

void tpar_emu_tma_load(void* smem, const void* map, const int* coords, int rank, void* bar) {
    MapView v;
    if (!decode_map(map, &v) || !check_smem_box(smem, v, "cp.async.bulk.tensor load")) return;
    if (!find_mbar(bar, "cp.async.bulk.tensor load")) return;
    const uintptr_t base = reinterpret_cast<uintptr_t>(smem);
    unsigned long long bytes = 0;
#ifdef TPAR_EMU_RACECHECK
    Launch* L = g_launch;
    const bool check = race::on(L);
    const unsigned t = check ? race::fid(L, L->current) : 0;
    const race::Epoch e = check ? race::agent_epoch(t) : race::Epoch{};
#endif
    for_each_box_element(v, coords, rank, [&](unsigned long long off, u64 src) {
        unsigned char* dst = reinterpret_cast<unsigned char*>(tma_swizzle(base + off, v.swizzle));
#ifdef TPAR_EMU_RACECHECK
        if (check) {
            if (src)
                race::async_access(L, e, race::row(t), reinterpret_cast<const void*>(src),
                                   v.esize, false, "a bulk tensor copy's read");
            race::async_access(L, e, race::row(t), dst, v.esize, true,
                               "a bulk tensor copy's write");
            if (!L->error.empty()) return;  // memcheck: not copied
        }
#endif
        if (src)
            std::memcpy(dst, reinterpret_cast<const void*>(src), v.esize);
        else
            std::memset(dst, 0, v.esize);  // out of bounds: zeros
        bytes += v.esize;
    });
#ifdef TPAR_EMU_RACECHECK
    if (check) {
        // complete_tx releases the copy's writes (and what its issuer knew)
        if (Mbar* m = find_mbar(bar, "cp.async.bulk.tensor load")) {
            race::mbar_release(m, race::row(t));
            m->acc[e.id] = std::max(m->acc[e.id], e.clk);
        }
    }
#endif
    mbar_complete_tx(bar, (long long)bytes);
}

void tpar_emu_tma_load_multicast(void* smem, const void* map, const int* coords, int rank,
                                 void* bar, unsigned mask) {
    Launch* L = g_launch;
    if (mask == 0 || (L->csize < 16 && (mask >> L->csize) != 0)) {
        tpar_emu_fail("a multicast bulk tensor copy whose mask names blocks outside the cluster");
        return;
    }
    for (unsigned r = 0; r < L->csize && L->error.empty(); ++r)
        if (mask & (1u << r))
            tpar_emu_tma_load(tpar_emu_mapa(smem, r), map, coords, rank, tpar_emu_mapa(bar, r));
}

void tpar_emu_tma_store(const void* map, const int* coords, int rank, const void* smem) {
    MapView v;
    if (!decode_map(map, &v) || !check_smem_box(smem, v, "cp.async.bulk.tensor store")) return;
    const uintptr_t base = reinterpret_cast<uintptr_t>(smem);
#ifdef TPAR_EMU_RACECHECK
    Launch* L = g_launch;
    const bool check = race::on(L);
    const unsigned t = check ? race::fid(L, L->current) : 0;
    const race::Epoch e = check ? race::agent_epoch(t) : race::Epoch{};
    if (check) L->current->race_bulk.push_back({-1, e.clk});
#endif
    for_each_box_element(v, coords, rank, [&](unsigned long long off, u64 dst) {
        const void* src = reinterpret_cast<const void*>(tma_swizzle(base + off, v.swizzle));
#ifdef TPAR_EMU_RACECHECK
        // the source is read whether or not the element is in bounds
        if (check) {
            race::async_access(L, e, race::row(t), src, v.esize, false,
                               "a bulk tensor store's read of its source");
            if (dst)
                race::async_access(L, e, race::row(t), reinterpret_cast<const void*>(dst),
                                   v.esize, true, "a bulk tensor store's write");
            if (!L->error.empty()) return;  // memcheck: not copied
        }
#endif
        if (!dst) return;  // out of bounds: not written
        std::memcpy(reinterpret_cast<void*>(dst), src, v.esize);
    });
}

// ---------------------------------------------------------------- wgmma

namespace {
struct WgmmaIn {
    const u32* a;  // A fragment (4 registers), or null: A from shared memory
    u64 desc_a, desc_b;
    const float* c;  // the accumulator as the thread's earlier operations leave it
};

// Flags of tpar_emu_wgmma (`kind` of the collective, with N << 8).
enum { WG_F16 = 1, WG_TA = 2, WG_TB = 4, WG_SCALE_D = 8, WG_A_REGS = 16 };

// Shared-memory address of element (mn, k) of a 16-bit operand under the
// canonical layouts of the PTX ISA ("Shared Memory Matrix Layout" of
// wgmma): T = 8 elements per 16 bytes, W = swizzle width in 16-byte units.
bool operand_addr(u64 desc, int mn, int k, bool mn_major, size_t* out) {
    Launch* L = g_launch;
    const u64 start = (desc & 0x3fffu) << 4;
    const u64 lbo = ((desc >> 16) & 0x3fffu) << 4;
    const u64 sbo = ((desc >> 32) & 0x3fffu) << 4;
    const unsigned base_offset = (desc >> 49) & 7u;
    const unsigned mode = (unsigned)(desc >> 62);
    if (base_offset != 0) {
        tpar_emu_fail("wgmma matrix descriptor with a non-zero base offset (not emulated: "
                      "start swizzled matrices on their pattern's boundary)");
        return false;
    }
    const unsigned W = mode == 0 ? 1 : mode == 1 ? 8 : mode == 2 ? 4 : 2;  // 16-byte units
    u64 off;
    if (!mn_major) {
        // ((8,m),(T,2k)) : ((W*T, SBO), (1, LBO or T))
        const u64 row = (u64)(mn % 8) * W * 16 + (u64)(mn / 8) * sbo;
        const u64 col = mode == 0 ? (u64)(k % 8) * 2 + (u64)(k / 8) * lbo : (u64)k * 2;
        off = row + col;
    } else if (mode == 0) {
        // ((T,1,m),(8,k)) : ((1,T,SBO),(T,LBO))
        off = (u64)(mn % 8) * 2 + (u64)(mn / 8) * sbo + (u64)(k % 8) * 16 + (u64)(k / 8) * lbo;
    } else {
        // ((T,W,m),(8,k)) : ((1,T,LBO),(W*T,SBO))
        off = (u64)(mn % (8 * W)) * 2 + (u64)(mn / (8 * W)) * lbo + (u64)(k % 8) * W * 16 +
              (u64)(k / 8) * sbo;
    }
    u64 a = start + off;
    if (mode != 0) {
        const u64 bits = mode == 1 ? 7 : mode == 2 ? 3 : 1;
        a ^= ((a >> 7) & bits) << 4;
    }
    if (a + 2 > L->smem_bytes) {
        tpar_emu_fail("a wgmma operand reaches past the end of dynamic shared memory");
        return false;
    }
    *out = (size_t)a;
    return true;
}

float bits16(u16 v, bool f16) {
    return f16 ? tpar_emu_f16_to_f32(v) : __uint_as_float(((u32)v) << 16);
}

void wgmma_combine(void* const* ins, void* const* outs, int kind) {
    Launch* L = g_launch;
    const int n = kind >> 8;
    const bool f16 = kind & WG_F16, ta = kind & WG_TA, tb = kind & WG_TB;
    const bool scale_d = kind & WG_SCALE_D, a_regs = kind & WG_A_REGS;
    const WgmmaIn* first = static_cast<const WgmmaIn*>(ins[0]);
    for (int t = 0; t < 128; ++t) {
        if (!ins[t]) {
            tpar_emu_fail("wgmma.mma_async with a thread of the warpgroup that has exited");
            return;
        }
        const WgmmaIn* in = static_cast<const WgmmaIn*>(ins[t]);
        if (in->desc_b != first->desc_b || (!a_regs && in->desc_a != first->desc_a)) {
            tpar_emu_fail("wgmma.mma_async with matrix descriptors that differ between the "
                          "threads of the warpgroup");
            return;
        }
    }
    static thread_local float A[64][16], B[16][256];
    for (int t = 0; t < 128; ++t) {
        if (!a_regs) break;
        const u32* r = static_cast<const WgmmaIn*>(ins[t])->a;
        const int w = t / 32, g = (t % 32) / 4, q = t % 4;
        for (int i = 0; i < 8; ++i) {
            const int row = 16 * w + g + 8 * ((i / 2) % 2), col = 2 * q + (i % 2) + 8 * (i / 4);
            const u32 reg = r[i / 2];
            A[row][col] = bits16((u16)(i % 2 ? reg >> 16 : reg & 0xffffu), f16);
        }
    }
#ifdef TPAR_EMU_RACECHECK
    // the operands are read by the warpgroup's operation: under an agent of
    // its first thread, with what every thread of it knew when it issued
    const bool check = race::on(L);
    race::Epoch e;
    std::vector<u32> known;  // the least every thread of the warpgroup knew
    if (check) {
        Group& grp = L->groups[L->current->group];
        const unsigned t0 = race::fid(L, grp.threads[0]);
        e = race::agent_epoch(t0);
        known.assign(race::row(t0), race::row(t0) + race::g.V);
        for (int t = 1; t < 128; ++t) {
            const u32* r = race::row(race::fid(L, grp.threads[t]));
            for (unsigned i = 0; i < race::g.V; ++i) known[i] = std::min(known[i], r[i]);
        }
        grp.race_agent = e.id;
        grp.race_clk = e.clk;
    }
#endif
    auto load = [&](u64 desc, int mn, int k, bool mn_major, float* v) {
        size_t off;
        if (!operand_addr(desc, mn, k, mn_major, &off)) return false;
        u16 h;
#ifdef TPAR_EMU_RACECHECK
        if (check)
            race::async_access(L, e, known.data(), cur_smem(L) + off, 2, false,
                               "a wgmma's read of its shared-memory operand");
#endif
        std::memcpy(&h, cur_smem(L) + off, 2);
        *v = bits16(h, f16);
        return true;
    };
    for (int k = 0; k < 16; ++k) {
        for (int m = 0; m < 64 && !a_regs; ++m)
            if (!load(first->desc_a, m, k, ta, &A[m][k])) return;
        for (int j = 0; j < n; ++j)
            if (!load(first->desc_b, j, k, tb, &B[k][j])) return;
    }
    for (int t = 0; t < 128; ++t) {
        const float* c = static_cast<const WgmmaIn*>(ins[t])->c;
        float* d = static_cast<float*>(outs[t]);
        const int w = t / 32, g = (t % 32) / 4, q = t % 4;
        for (int i = 0; i < n / 2; ++i) {
            const int row = 16 * w + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * q + (i % 2);
            float s = 0.0f;
            for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
            d[i] = scale_d ? c[i] + s : s;
        }
    }
}
}  // namespace

void tpar_emu_wgmma(float* d, int n, const u32* a, u64 desc_a, u64 desc_b, int flags) {
    Launch* L = g_launch;
    Fiber* f = L->current;
    if (n < 8 || n > 256 || n % 8 != 0) {
        tpar_emu_fail("wgmma.mma_async with N not a multiple of 8 in 8..256");
        return;
    }
    WgmmaIn in{a, desc_a, desc_b, d};
    // an accumulator still in flight: the new operation adds to its result
    for (auto it = f->wgmma.rbegin(); it != f->wgmma.rend(); ++it)
        if (it->d == d) {
            in.c = it->vals;
            break;
        }
    WgmmaPending p;
    p.d = d;
    p.count = n / 2;
    tpar_emu_warpgroup_collective(&in, p.vals, &wgmma_combine, (n << 8) | flags | (a ? WG_A_REGS : 0));
    p.agent = L->groups[f->group].race_agent;
    p.agent_clk = L->groups[f->group].race_clk;
    f->wgmma.push_back(p);
    const float nan = __uint_as_float(0x7fc00000u);
    for (int i = 0; i < n / 2; ++i) d[i] = nan;
}

void tpar_emu_wgmma_fence() {}

void tpar_emu_wgmma_commit() {
    Fiber* f = g_launch->current;
    bool any = false;
    for (auto& p : f->wgmma)
        if (p.group < 0) {
            p.group = f->wgmma_groups;
            any = true;
        }
    (void)any;
    f->wgmma_groups++;
}

void tpar_emu_wgmma_wait(int n) {
    Fiber* f = g_launch->current;
    if (n < 0 || n > 7) {
        tpar_emu_fail("wgmma.wait_group with N outside 0..7");
        return;
    }
    retire_groups(f->wgmma, f->wgmma_groups - n, [f](WgmmaPending& p) {
        std::memcpy(p.d, p.vals, sizeof(float) * p.count);
#ifdef TPAR_EMU_RACECHECK
        // the operation's operand reads are done
        if (p.agent_clk && race::on(g_launch)) {
            u32& k = race::row(race::fid(g_launch, f))[p.agent];
            k = std::max(k, p.agent_clk);
        }
#endif
        (void)f;
    });
}

// ---------------------------------------------------------------- bulk reductions

void tpar_emu_bulk_reduce_add_f32(float* gmem, const float* smem, unsigned bytes) {
    Launch* L = g_launch;
    char buf[200];
    if (reinterpret_cast<uintptr_t>(gmem) % 16 != 0 || reinterpret_cast<uintptr_t>(smem) % 16 != 0 ||
        bytes % 16 != 0) {
        std::snprintf(buf, sizeof buf,
                      "cp.reduce.async.bulk with global address %p, shared address %p, size %u: "
                      "addresses must be 16-byte aligned and the size a multiple of 16",
                      static_cast<void*>(gmem), static_cast<const void*>(smem), bytes);
        tpar_emu_fail(buf);
        return;
    }
    const unsigned off = tpar_emu_smem_offset(smem);
    if (!L->error.empty()) return;
    if ((size_t)off + bytes > L->smem_bytes) {
        std::snprintf(buf, sizeof buf,
                      "cp.reduce.async.bulk of %u bytes from shared offset %u reaches past the "
                      "%zu bytes of dynamic shared memory",
                      bytes, off, L->smem_bytes);
        tpar_emu_fail(buf);
        return;
    }
    if (bytes == 0) return;
#ifdef TPAR_EMU_RACECHECK
    if (race::on(L)) {
        const unsigned t = race::fid(L, L->current);
        const race::Epoch e = race::agent_epoch(t);
        race::async_access(L, e, race::row(t), smem, bytes, false,
                           "a bulk reduction's read of its source");
        race::async_access(L, e, race::row(t), gmem, bytes, true, "a bulk reduction's add",
                           race::ATOMIC);
        L->current->race_bulk.push_back({-1, e.clk});
    }
    if (!L->error.empty()) return;  // memcheck: not queued
#endif
    BulkPending p;
    p.dst = gmem;
    p.src = smem;
    p.count = bytes / 4;
    L->current->bulk.push_back(p);
}

void tpar_emu_bulk_commit() {
    Fiber* f = g_launch->current;
    for (auto& p : f->bulk)
        if (p.group < 0) p.group = f->bulk_groups;
    for (auto& p : f->race_bulk)
        if (p.first < 0) p.first = f->bulk_groups;
    f->bulk_groups++;
}

void tpar_emu_bulk_wait(int n) {
    Fiber* f = g_launch->current;
    if (n < 0) {
        tpar_emu_fail("cp.async.bulk.wait_group with a negative count");
        return;
    }
    retire_groups(f->bulk, f->bulk_groups - n, [](BulkPending& p) {
        for (unsigned i = 0; i < p.count; ++i) p.dst[i] += p.src[i];
    });
    TPAR_RACE(race::retire(f->race_bulk, f->bulk_groups - n, race::fid(g_launch, f)));
}

// Runs a whole launch (blocks `cluster` at a time, together) of a kernel
// whose argument struct is the `args_len` bytes at `args`; returns 0, or 1
// with a message in `err`. `flags` bit 0 (strict): the launch's global
// memory is device memory registered with tpar_emu_track (memcheck checks
// every global access against it); bit 1: the clusters run in an order drawn
// from `seed` instead of the grid's.
int tpar_emu_launch_cluster(void (*kernel)(const void*), const void* args, size_t args_len,
                            const unsigned grid[3], const unsigned block[3],
                            const unsigned cluster[3], size_t dyn_smem, int flags,
                            unsigned long long seed, char* err, size_t errlen) {
    std::lock_guard<std::mutex> lock(g_mutex);
    Launch L;
    L.kernel = kernel;
    L.args = args;
    L.args_len = args_len;
    L.strict = (flags & 1) != 0;
    L.grid = dim3{grid[0], grid[1], grid[2]};
    L.block = dim3{block[0], block[1], block[2]};
    L.cluster = dim3{cluster[0], cluster[1], cluster[2]};
    L.csize = cluster[0] * cluster[1] * cluster[2];
    L.rng = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (L.rng == 0) L.rng = 1;
    const unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
    if (nthreads == 0 || nthreads > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        fail(&L, "empty grid or block, or more than 1024 threads per block");
    } else if (nthreads % 32 != 0) {
        fail(&L, "threads per block must be a multiple of 32 in the emulator");
    } else if (dyn_smem > kMaxDynSmem) {
        fail(&L, "more dynamic shared memory than a block can have (227 KiB)");
    } else if (L.csize == 0 || L.csize > 16 || grid[0] % cluster[0] || grid[1] % cluster[1] ||
               grid[2] % cluster[2]) {
        fail(&L, "a cluster of 1 to 16 blocks that divides the grid in every dimension is needed");
    }
    if (!L.error.empty()) {
        if (errlen > 0) std::snprintf(err, errlen, "%s", L.error.c_str());
        return 1;
    }
    L.smem_bytes = dyn_smem;
    L.ctas.resize(L.csize);
#ifdef TPAR_EMU_RACECHECK
    // memcheck: the largest window a block can have from its start, and 1 KiB
    // before it, so that offsets a block reaches outside its own bytes land
    // here and show
    const size_t window = kMaxDynSmem, before = 1024;
#else
    const size_t window = dyn_smem, before = 0;
#endif
    for (Cta& c : L.ctas) {
        c.dyn_smem.assign(before + window + 16 + 1024, 0);
        uintptr_t p = reinterpret_cast<uintptr_t>(c.dyn_smem.data()) + before;
        c.smem = c.dyn_smem.data() + before + ((1024 - p % 1024) % 1024);
    }
    g_launch = &L;
    install_fault_handler();
    g_runner = pthread_self();
    g_running.store(&L, std::memory_order_release);
    TPAR_RACE(race::begin_launch());
    // The clusters run one at a time, in the grid's order or (flags bit 1) in
    // an order drawn from the seed: a GPU runs blocks in any order (and at
    // once), so a result that depends on their order (float atomics of
    // several blocks into one value) changes between runs there, and here
    // between seeds. The drawn order is the affine permutation
    // i -> (a i + b) mod count, with a coprime to count.
    const unsigned long long nx = grid[0] / cluster[0], ny = grid[1] / cluster[1];
    const unsigned long long count = nx * ny * (grid[2] / cluster[2]);
    unsigned long long a = 1, b = 0;
    if (count > 1 && (flags & 2) != 0) {
        b = next_rand(&L) % count;
        auto gcd = [](unsigned long long u, unsigned long long v) {
            while (v != 0) {
                const unsigned long long t = u % v;
                u = v;
                v = t;
            }
            return u;
        };
        do a = 1 + next_rand(&L) % (count - 1);
        while (gcd(a, count) != 1);
    }
    L.order_a = a;
    L.order_b = b;
    L.order_count = count;
    for (unsigned long long i = 0; i < count && L.error.empty(); ++i) {
        const unsigned long long j = L.cluster_of(i);
        const unsigned x = (unsigned)(j % nx) * cluster[0];
        const unsigned y = (unsigned)((j / nx) % ny) * cluster[1];
        const unsigned z = (unsigned)(j / (nx * ny)) * cluster[2];
        for (unsigned r = 0; r < L.csize; ++r) {
            Cta& c = L.ctas[r];
            // ranks in the cluster: x fastest, as %cluster_ctarank
            c.bidx = dim3{x + r % cluster[0], y + (r / cluster[0]) % cluster[1],
                          z + r / (cluster[0] * cluster[1])};
            // fill dynamic shared memory with a pattern: kernels must not
            // rely on it starting at zero
            std::memset(c.dyn_smem.data(), 0xA5, before + dyn_smem + 16 + 1024);
        }
        run_cluster(&L);
    }
    g_running.store(nullptr, std::memory_order_release);
    g_launch = nullptr;
    if (!L.error.empty()) {
        if (errlen > 0) std::snprintf(err, errlen, "%s", L.error.c_str());
        return 1;
    }
    return 0;
}

// Runs a whole launch without clusters.
int tpar_emu_launch(void (*kernel)(const void*), const void* args, size_t args_len,
                    const unsigned grid[3], const unsigned block[3], size_t dyn_smem, int flags,
                    unsigned long long seed, char* err, size_t errlen) {
    const unsigned one[3] = {1, 1, 1};
    return tpar_emu_launch_cluster(kernel, args, args_len, grid, block, one, dyn_smem, flags,
                                   seed, err, errlen);
}

#ifdef TPAR_EMU_RACECHECK
// memcheck: registers (`live`) or unregisters the device allocation of
// `bytes` at `p` (allocations never overlap).
void tpar_emu_track(const void* p, size_t bytes, int live) {
    race::Allocs& A = race::allocs();
    std::lock_guard<std::mutex> lock(A.mu);
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    if (live) {
        A.live[at] = race::Alloc{at + bytes, std::vector<u8>((bytes + 7) / 8, 0)};
        return;
    }
    auto it = A.live.find(at);
    if (it == A.live.end()) return;
    A.freed.push_back({it->first, it->second.end});
    if (A.freed.size() > race::kFreedKept) A.freed.pop_front();
    A.live.erase(it);
}

// initcheck: the host side wrote [p, p + bytes) of device memory (a copy or a
// memset).
void tpar_emu_written(const void* p, size_t bytes) {
    race::Allocs& A = race::allocs();
    std::lock_guard<std::mutex> lock(A.mu);
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    if (auto* h = race::holding(A, at)) race::mark_written(h->second, h->first, at, bytes);
}
#endif

}  // extern "C"

#ifdef TPAR_EMU_RACECHECK
// The instrumentation of -fsanitize=thread calls these on every memory
// access of kernel code; racecheck keeps those to shared memory (above).
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
// The aligned hooks' width is the alignment the access's type promises (GCC
// calls them only then; Clang also for 16-byte accesses aligned to 8).
#ifdef __clang__
#define TPAR_TSAN_ALIGN(n) ((n) < 8 ? (n) : 8)
#else
#define TPAR_TSAN_ALIGN(n) (n)
#endif
#define TPAR_TSAN_ACCESS(n)                                                                   \
    void __tsan_read##n(void* p) {                                                            \
        race::thread_access(p, n, false, race::GENERIC, __builtin_return_address(0),          \
                            TPAR_TSAN_ALIGN(n));                                              \
    }                                                                                         \
    void __tsan_write##n(void* p) {                                                           \
        race::thread_access(p, n, true, race::GENERIC, __builtin_return_address(0),           \
                            TPAR_TSAN_ALIGN(n));                                              \
    }                                                                                         \
    void __tsan_unaligned_read##n(void* p) {                                                  \
        race::thread_access(p, n, false, race::GENERIC, __builtin_return_address(0));         \
    }                                                                                         \
    void __tsan_unaligned_write##n(void* p) {                                                 \
        race::thread_access(p, n, true, race::GENERIC, __builtin_return_address(0));          \
    }
TPAR_TSAN_ACCESS(1)
TPAR_TSAN_ACCESS(2)
TPAR_TSAN_ACCESS(4)
TPAR_TSAN_ACCESS(8)
TPAR_TSAN_ACCESS(16)
void __tsan_read_range(void* p, unsigned long n) {
    race::thread_access(p, n, false, race::GENERIC, __builtin_return_address(0));
}
void __tsan_write_range(void* p, unsigned long n) {
    race::thread_access(p, n, true, race::GENERIC, __builtin_return_address(0));
}
}
#endif

// Fiber scheduler of the CPU emulator (see emu.h).
//
// A launch runs its blocks in order. Each thread of a block is a fiber
// (ucontext) with its own stack. A fiber runs until it reaches a block
// barrier or a warp operation; the scheduler then runs the other runnable
// fibers: warps one at a time in an order shuffled from the launch seed,
// each up to its next barrier, so that a missing barrier between one warp's
// write and another's read usually shows.
// A barrier completes when every live thread of the block has reached it; a
// warp operation when every live lane of the warp has. When nothing can run
// and nothing can complete, the launch fails with a deadlock report.
#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "emu.h"

namespace {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int lane = 0, warp = 0;
    State state = RUNNABLE;
    void* in = nullptr;
    void* out = nullptr;
    tpar_emu_combine_fn combine = nullptr;
    int kind = 0;
};

struct Warp {
    int arrived = 0;
    int live = 0;
    tpar_emu_combine_fn combine = nullptr;
    int kind = 0;
    Fiber* lanes[32] = {};
};

constexpr size_t kStack = 256 * 1024;
constexpr size_t kMaxDynSmem = 227 * 1024;

struct Launch {
    void (*kernel)(const void*) = nullptr;
    const void* args = nullptr;
    dim3 grid{}, block{}, bidx{};
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<unsigned char> dyn_smem;
    ucontext_t sched;
    Fiber* current = nullptr;
    std::string error;
    unsigned long long rng = 0;
};

thread_local Launch* g_launch = nullptr;
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
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", g_launch->bidx.x,
                  g_launch->bidx.y, g_launch->bidx.z, f->tid.x, f->tid.y, f->tid.z);
    return buf;
}

void fiber_entry() {
    Launch* L = g_launch;
    L->kernel(L->args);
    L->current->state = DONE;
    // returning resumes the scheduler through uc_link
}

// Yields from the running fiber back to the scheduler.
void yield_to_scheduler() {
    Launch* L = g_launch;
    swapcontext(&L->current->ctx, &L->sched);
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
    for (int l = 0; l < 32; ++l) {
        Fiber* f = w.lanes[l];
        if (f && f->state == AT_WARP) f->state = RUNNABLE;
    }
    w.arrived = 0;
    w.combine = nullptr;
}

void run_block(Launch* L) {
    const unsigned nthreads = L->block.x * L->block.y * L->block.z;
    const unsigned nwarps = (nthreads + 31) / 32;
    L->fibers.assign(nthreads, Fiber{});
    L->warps.assign(nwarps, Warp{});
    while (g_stacks.size() < nthreads) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            fail(L, "could not map fiber stacks");
            return;
        }
        g_stacks.push_back(static_cast<char*>(p));
    }
    for (unsigned i = 0; i < nthreads; ++i) {
        Fiber& f = L->fibers[i];
        f.tid = dim3{i % L->block.x, (i / L->block.x) % L->block.y, i / (L->block.x * L->block.y)};
        f.lane = i % 32;
        f.warp = i / 32;
        L->warps[f.warp].lanes[f.lane] = &f;
        L->warps[f.warp].live++;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[i];
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &L->sched;
        makecontext(&f.ctx, fiber_entry, 0);
    }
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
                    if (f.state != RUNNABLE) continue;
                    ran = progress = true;
                    L->current = &f;
                    swapcontext(&L->sched, &f.ctx);
                    L->current = nullptr;
                    if (f.state == DONE) {
                        --live;
                        Warp& wp = L->warps[f.warp];
                        wp.live--;
                        if (wp.arrived > 0 && wp.arrived == wp.live) complete_warp(wp);
                    }
                }
            }
        }
        if (ran || live == 0 || !L->error.empty()) continue;
        unsigned at_barrier = 0;
        for (auto& f : L->fibers) at_barrier += f.state == AT_BARRIER;
        if (at_barrier == live) {
            for (auto& f : L->fibers)
                if (f.state == AT_BARRIER) f.state = RUNNABLE;
            continue;
        }
        // Nothing can run: describe who waits where.
        std::string msg = "deadlock: ";
        char buf[200];
        std::snprintf(buf, sizeof buf,
                      "%u of %u live threads wait at __syncthreads, the others at warp operations "
                      "some lanes of their warp never reach (",
                      at_barrier, live);
        msg += buf;
        int shown = 0;
        for (auto& f : L->fibers) {
            if (f.state == AT_WARP && shown < 3) {
                msg += (shown ? ", " : "") + where(&f);
                ++shown;
            }
        }
        msg += ")";
        fail(L, msg);
    }
}

}  // namespace

extern "C" {

const dim3* tpar_emu_thread_idx() { return &g_launch->current->tid; }
const dim3* tpar_emu_block_idx() { return &g_launch->bidx; }
const dim3* tpar_emu_block_dim() { return &g_launch->block; }
const dim3* tpar_emu_grid_dim() { return &g_launch->grid; }
unsigned char* tpar_emu_dyn_smem_ptr() { return g_launch->dyn_smem.data(); }

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
    if (pred)
        std::memcpy(smem, gmem, 16);
    else
        std::memset(smem, 0, 16);
}

// Runs a whole launch; returns 0, or 1 with a message in `err`.
int tpar_emu_launch(void (*kernel)(const void*), const void* args, const unsigned grid[3],
                    const unsigned block[3], size_t dyn_smem, unsigned long long seed, char* err,
                    size_t errlen) {
    std::lock_guard<std::mutex> lock(g_mutex);
    Launch L;
    L.kernel = kernel;
    L.args = args;
    L.grid = dim3{grid[0], grid[1], grid[2]};
    L.block = dim3{block[0], block[1], block[2]};
    L.rng = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (L.rng == 0) L.rng = 1;
    const unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
    if (nthreads == 0 || nthreads > 1024 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        fail(&L, "empty grid or block, or more than 1024 threads per block");
    } else if (nthreads % 32 != 0) {
        fail(&L, "threads per block must be a multiple of 32 in the emulator");
    } else if (dyn_smem > kMaxDynSmem) {
        fail(&L, "more dynamic shared memory than a block can have (227 KiB)");
    }
    L.dyn_smem.assign(dyn_smem + 16, 0);
    g_launch = &L;
    for (unsigned z = 0; z < grid[2] && L.error.empty(); ++z)
        for (unsigned y = 0; y < grid[1] && L.error.empty(); ++y)
            for (unsigned x = 0; x < grid[0] && L.error.empty(); ++x) {
                L.bidx = dim3{x, y, z};
                // fill dynamic shared memory with a pattern: kernels must not
                // rely on it starting at zero
                std::memset(L.dyn_smem.data(), 0xA5, L.dyn_smem.size());
                run_block(&L);
            }
    g_launch = nullptr;
    if (!L.error.empty()) {
        if (errlen > 0) std::snprintf(err, errlen, "%s", L.error.c_str());
        return 1;
    }
    return 0;
}

}  // extern "C"

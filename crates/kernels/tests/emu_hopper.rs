//! The emulator's Hopper instructions against the PTX ISA: mbarrier phases and
//! parities, bulk tensor copies through tensor maps (box, strides, the 32/64/128
//! byte swizzles, out-of-bounds zeros, clipped stores), wgmma.mma_async (the
//! accumulator and A register fragments, the canonical shared-memory layouts
//! of K-major and M/N-major operands under every swizzle mode), a small GEMM
//! built from them, compared with a CPU matmul, and thread-block clusters
//! (distributed shared memory, the cluster barrier, remote mbarrier arrivals,
//! multicast copies), and the 1-D bulk reduction (cp.reduce.async.bulk add.f32:
//! its size, alignment and bulk-group completion).
//!
//! The expected layouts are written here from the ISA's definitions, not from
//! the emulator's code: a wrong fragment, layout or swizzle in the emulator
//! makes these tests fail.

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::tensor_map::{TensorMap, TensorMapDType, TensorMapSwizzle, TiledDesc};
use tpar_kernels::cuda::{launch, DevPtr, LaunchConfig};

const SRC: &str = include_str!("hopper/kernels.cu");

fn emu() -> &'static Emulator {
    let e = Emulator::get().expect("emulator");
    static ADDED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ADDED
        .get_or_init(|| e.add_source("hopper_test", SRC).expect("the Hopper test kernels compile"));
    e
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MbarArgs {
    out: DevPtr,
    rounds: i32,
    mode: i32,
}

#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct TmaArgs {
    map: TensorMap,
    src: DevPtr,
    out: DevPtr,
    x: i32,
    y: i32,
    bytes: i32,
    extra_tx: i32,
    pad: [u64; 4],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct WgmmaArgs {
    a: DevPtr,
    b: DevPtr,
    c: DevPtr,
    out: DevPtr,
    a_bytes: u32,
    b_bytes: u32,
    b_at: u32,
    a_start: u32,
    b_start: u32,
    lbo_a: u32,
    sbo_a: u32,
    lbo_b: u32,
    sbo_b: u32,
    mode_a: i32,
    mode_b: i32,
    variant: i32,
    accumulate: i32,
    early_read: i32,
}

#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GemmTileArgs {
    map_a: TensorMap,
    map_b: TensorMap,
    c: DevPtr,
    m: i32,
    n: i32,
    k: i32,
    pad: [i32; 11],
}

const BULK_SRC: &str = include_str!("hopper/bulk_reduce.cu");

fn run<A: bytemuck::Pod>(name: &str, cfg: LaunchConfig, args: &A) -> tpar_kernels::Result<()> {
    // SAFETY: every test passes host buffers covering what its kernel reads
    // and writes (see the kernels in hopper/kernels.cu), kept alive across
    // the launch, and tensor maps over such buffers.
    unsafe { launch(emu(), name, cfg, args) }
}

// ---------------------------------------------------------------- mbarrier

#[test]
fn mbarrier_phases_order_a_producer_and_consumers() {
    let rounds = 5;
    let mut out = vec![0f32; rounds * 96];
    for seed in 0..4 {
        emu().set_seed(seed);
        out.fill(-1.0);
        let args = MbarArgs { out: out.as_mut_ptr() as DevPtr, rounds: rounds as i32, mode: 0 };
        run("hopper_mbar_ring", LaunchConfig::linear(1, 128), &args).unwrap();
        for r in 0..rounds {
            let want: f32 = (0..32).map(|l| (r * 100 + l) as f32).sum();
            for c in 0..96 {
                assert_eq!(out[r * 96 + c], want, "seed {seed} round {r} consumer {c}");
            }
        }
    }
    emu().set_seed(0x7470_6172);
}

fn misuse(mode: i32) -> tpar_kernels::Result<()> {
    let mut out = vec![0f32; 128];
    let args = MbarArgs { out: out.as_mut_ptr() as DevPtr, rounds: 0, mode };
    run("hopper_mbar_misuse", LaunchConfig::linear(1, 128), &args)
}

#[test]
fn mbarrier_misuse_is_reported_not_hung() {
    let parity = misuse(0).unwrap_err().to_string();
    assert!(parity.contains("deadlock") && parity.contains("mbarrier"), "{parity}");
    assert!(parity.contains("waiting for parity 1"), "{parity}");
    let tx = misuse(1).unwrap_err().to_string();
    assert!(tx.contains("deadlock") && tx.contains("64 transaction bytes pending"), "{tx}");
    let uninit = misuse(2).unwrap_err().to_string();
    assert!(uninit.contains("never initialized"), "{uninit}");
    misuse(3).expect("the correct use runs");
}

// ---------------------------------------------------------------- TMA

/// Where byte `o` of a box (its row-major image, rows of `16 * w` bytes)
/// lands under a swizzle `w` 16-byte chunks wide (1: none). The CUDA
/// programming guide's patterns: in the 128-byte swizzle the 16-byte chunk
/// `c` of row `r` goes to chunk `c ^ (r % 8)`; in the 64-byte one to
/// `c ^ ((r / 2) % 4)`; in the 32-byte one to `c ^ ((r / 4) % 2)` (the
/// pattern repeating every 1024, 512, 256 bytes).
fn swizzled(o: usize, w: usize) -> usize {
    if w == 1 {
        return o;
    }
    let row_bytes = 16 * w;
    let (r, c) = (o / row_bytes, (o % row_bytes) / 16);
    r * row_bytes + (c ^ ((r / (8 / w)) % w)) * 16 + o % 16
}

fn chunks(s: TensorMapSwizzle) -> usize {
    match s {
        TensorMapSwizzle::None => 1,
        TensorMapSwizzle::B32 => 2,
        TensorMapSwizzle::B64 => 4,
        TensorMapSwizzle::B128 => 8,
    }
}

/// A `rows x cols` tensor of `esize`-byte elements with rows `pitch` bytes
/// apart; element (r, c) is distinct and never zero.
struct Tensor2 {
    esize: usize,
    cols: usize,
    rows: usize,
    pitch: usize,
    bytes: Vec<u8>,
}

impl Tensor2 {
    fn new(esize: usize, cols: usize, rows: usize, pitch: usize) -> Tensor2 {
        let mut bytes = vec![0u8; rows * pitch + 256];
        for r in 0..rows {
            for c in 0..cols {
                let v = (r * cols + c) as u64 * 2654435761 % 65521 + 1;
                let at = r * pitch + c * esize;
                bytes[at..at + esize].copy_from_slice(&v.to_le_bytes()[..esize]);
            }
        }
        Tensor2 { esize, cols, rows, pitch, bytes }
    }

    fn base(&self) -> u64 {
        let p = self.bytes.as_ptr() as u64;
        p.next_multiple_of(16)
    }

    fn map(&self, box_dims: [u32; 2], swizzle: TensorMapSwizzle) -> TensorMap {
        let dtype = if self.esize == 2 { TensorMapDType::BF16 } else { TensorMapDType::F32 };
        TensorMap::encode_tiled_emulated(&TiledDesc {
            dtype,
            global: self.base(),
            dims: &[self.cols as u64, self.rows as u64],
            strides: &[self.pitch as u64],
            box_dims: &box_dims,
            swizzle,
        })
        .unwrap()
    }

    /// The element at (row, col) as bytes, or None outside the tensor.
    fn at(&self, r: i64, c: i64) -> Option<&[u8]> {
        if r < 0 || c < 0 || r >= self.rows as i64 || c >= self.cols as i64 {
            return None;
        }
        let off = (self.base() - self.bytes.as_ptr() as u64) as usize;
        let at = off + r as usize * self.pitch + c as usize * self.esize;
        Some(&self.bytes[at..at + self.esize])
    }
}

/// Every swizzle mode, with the box width it needs, for both element sizes.
fn tma_cases() -> Vec<(usize, TensorMapSwizzle, u32)> {
    let mut v = Vec::new();
    for esize in [2usize, 4] {
        v.push((esize, TensorMapSwizzle::None, (48 / esize) as u32));
        for s in [TensorMapSwizzle::B32, TensorMapSwizzle::B64, TensorMapSwizzle::B128] {
            v.push((esize, s, (s.bytes() / esize) as u32));
        }
    }
    v
}

#[test]
fn tma_loads_boxes_swizzled_with_zeros_outside() {
    for (esize, swizzle, inner) in tma_cases() {
        let t = Tensor2::new(esize, 136 / esize, 40, 176);
        let rows = 16u32;
        let map = t.map([inner, rows], swizzle);
        let w = chunks(swizzle);
        let bytes = inner as usize * esize * rows as usize;
        let (cols, nrows) = (t.cols as i32, t.rows as i32);
        for (x, y) in [(0, 0), (3, 5), (cols - 7, nrows - 9), (-5, -3), (cols + 4, 0)] {
            let mut out = vec![0x5Au8; bytes];
            let args = TmaArgs {
                map,
                src: 0,
                out: out.as_mut_ptr() as DevPtr,
                x,
                y,
                bytes: bytes as i32,
                extra_tx: 0,
                pad: [0; 4],
            };
            run(
                "hopper_tma_load",
                LaunchConfig::linear(1, 128).with_shared(bytes as u32 + 1024),
                &args,
            )
            .unwrap();
            for r in 0..rows as usize {
                for c in 0..inner as usize {
                    let o = swizzled((r * inner as usize + c) * esize, w);
                    let got = &out[o..o + esize];
                    let zero = vec![0u8; esize];
                    let want = t.at(y as i64 + r as i64, x as i64 + c as i64).unwrap_or(&zero);
                    assert_eq!(
                        got, want,
                        "esize {esize} {swizzle:?} box at ({x}, {y}): element ({r}, {c})"
                    );
                }
            }
        }
    }
}

#[test]
fn tma_load_expecting_more_bytes_than_arrive_deadlocks() {
    let t = Tensor2::new(2, 64, 16, 128);
    let map = t.map([64, 8], TensorMapSwizzle::B128);
    let mut out = vec![0u8; 1024];
    let args = TmaArgs {
        map,
        src: 0,
        out: out.as_mut_ptr() as DevPtr,
        x: 0,
        y: 0,
        bytes: 1024,
        extra_tx: 16,
        pad: [0; 4],
    };
    let e = run("hopper_tma_load", LaunchConfig::linear(1, 128).with_shared(2048), &args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("deadlock") && e.contains("16 transaction bytes pending"), "{e}");
}

#[test]
fn tma_stores_boxes_unswizzled_and_clipped() {
    for (esize, swizzle, inner) in tma_cases() {
        let rows = 8u32;
        let bytes = inner as usize * esize * rows as usize;
        let image: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251 + 1) as u8).collect();
        let w = chunks(swizzle);
        for (x, y) in [(0i32, 0i32), (5, 3), (-4, -2), (20, 30)] {
            let mut t = Tensor2::new(esize, 80 / esize, 36, 96);
            t.bytes.fill(0xEE);
            let map = t.map([inner, rows], swizzle);
            let args = TmaArgs {
                map,
                src: image.as_ptr() as DevPtr,
                out: 0,
                x,
                y,
                bytes: bytes as i32,
                extra_tx: 0,
                pad: [0; 4],
            };
            run(
                "hopper_tma_store",
                LaunchConfig::linear(1, 128).with_shared(bytes as u32 + 1024),
                &args,
            )
            .unwrap();
            let mut written = 0;
            for r in 0..t.rows as i64 {
                for c in 0..t.cols as i64 {
                    let (br, bc) = (r - y as i64, c - x as i64);
                    let inside = (0..rows as i64).contains(&br) && (0..inner as i64).contains(&bc);
                    let want: Vec<u8> = if inside {
                        written += 1;
                        let o = swizzled((br as usize * inner as usize + bc as usize) * esize, w);
                        image[o..o + esize].to_vec()
                    } else {
                        vec![0xEE; esize]
                    };
                    assert_eq!(
                        t.at(r, c).unwrap(),
                        &want[..],
                        "esize {esize} {swizzle:?} box at ({x}, {y}): tensor element ({r}, {c})"
                    );
                }
            }
            assert!(written > 0 || x >= 20, "the box at ({x}, {y}) wrote nothing");
        }
    }
}

#[test]
fn tma_3d_boxes_load_and_store_through_the_third_dim() {
    // a 4 x 10 x 24 bf16 tensor (planes of 10 rows of 24, rows 64 bytes apart,
    // planes 704 bytes apart); boxes of 2 planes x 4 rows x 32 elements
    let (cols, rows, planes, pitch, plane) = (24usize, 10usize, 4usize, 64usize, 704usize);
    let mut data = vec![0u16; plane / 2 * planes + 64];
    let base = data.as_ptr() as usize;
    let off = (base.next_multiple_of(16) - base) / 2;
    let idx = |z: usize, y: usize, x: usize| off + z * plane / 2 + y * pitch / 2 + x;
    for z in 0..planes {
        for y in 0..rows {
            for x in 0..cols {
                data[idx(z, y, x)] = (1 + z * 1000 + y * 40 + x) as u16;
            }
        }
    }
    let before = data.clone();
    let map = TensorMap::encode_tiled_emulated(&TiledDesc {
        dtype: TensorMapDType::BF16,
        global: data[off..].as_mut_ptr() as u64,
        dims: &[cols as u64, rows as u64, planes as u64],
        strides: &[pitch as u64, plane as u64],
        box_dims: &[32, 4, 2],
        swizzle: TensorMapSwizzle::B64,
    })
    .unwrap();
    let (x, y, z) = (-4i32, 7i32, 1i32);
    let bytes = 32 * 4 * 2 * 2;
    let mut out = vec![0u8; bytes];
    let args = TmaArgs {
        map,
        src: 0,
        out: out.as_mut_ptr() as DevPtr,
        x,
        y,
        bytes: bytes as i32,
        extra_tx: z,
        pad: [0; 4],
    };
    run("hopper_tma_3d", LaunchConfig::linear(1, 128).with_shared(bytes as u32 + 1024), &args)
        .unwrap();
    let value = |d: &[u16], gz: i64, gy: i64, gx: i64| -> u16 {
        let inside = (0..planes as i64).contains(&gz)
            && (0..rows as i64).contains(&gy)
            && (0..cols as i64).contains(&gx);
        if inside {
            d[idx(gz as usize, gy as usize, gx as usize)]
        } else {
            0
        }
    };
    for bz in 0..2i64 {
        for by in 0..4i64 {
            for bx in 0..32i64 {
                let o = swizzled((((bz * 4 + by) * 32 + bx) * 2) as usize, 4);
                let got = u16::from_le_bytes([out[o], out[o + 1]]);
                let want = value(&before, z as i64 + bz, y as i64 + by, x as i64 + bx);
                assert_eq!(got, want, "load: box element ({bz}, {by}, {bx})");
            }
        }
    }
    // the store wrote the loaded box one plane further, clipped to the tensor
    for gz in 0..planes as i64 {
        for gy in 0..rows as i64 {
            for gx in 0..cols as i64 {
                let (bz, by, bx) = (gz - z as i64 - 1, gy - y as i64, gx - x as i64);
                let inside = (0..2).contains(&bz) && (0..4).contains(&by) && (0..32).contains(&bx);
                let want = if inside {
                    value(&before, gz - 1, gy, gx)
                } else {
                    before[idx(gz as usize, gy as usize, gx as usize)]
                };
                let got = data[idx(gz as usize, gy as usize, gx as usize)];
                assert_eq!(got, want, "store: tensor element ({gz}, {gy}, {gx})");
            }
        }
    }
}

#[test]
fn bad_tensor_maps_are_refused() {
    let t = Tensor2::new(2, 64, 16, 128);
    let d = TiledDesc {
        dtype: TensorMapDType::BF16,
        global: t.base(),
        dims: &[64, 16],
        strides: &[128],
        box_dims: &[64, 8],
        swizzle: TensorMapSwizzle::B64,
    };
    let e = TensorMap::encode_tiled_emulated(&d).unwrap_err().to_string();
    assert!(e.contains("wider than the 64-byte swizzle"), "{e}");
    let e = TensorMap::encode_tiled_emulated(&TiledDesc { strides: &[100], ..d }).unwrap_err();
    assert!(e.to_string().contains("multiple of 16"), "{e}");
}

// ---------------------------------------------------------------- wgmma

/// A shared-memory operand of wgmma: M/N-major or K-major, swizzle width
/// `w` in 16-byte chunks (1: none), leading and stride byte offsets.
#[derive(Clone, Copy, Debug)]
struct Layout {
    mn_major: bool,
    w: usize,
    lbo: usize,
    sbo: usize,
}

impl Layout {
    /// The byte offset of element (mn, k) of a 16-bit operand before
    /// swizzling: the PTX ISA's canonical layouts ("Shared Memory Matrix
    /// Layout", in CuTe notation, T = 8 elements per 16 bytes):
    /// K-major none ((8,m),(T,2k)):((1T,SBO),(1,LBO)); K-major swizzled
    /// ((8,m),(T,2k)):((wT,SBO),(1,T)); MN-major none
    /// ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)); MN-major swizzled
    /// ((T,w,m),(8,k)):((1,T,LBO),(wT,SBO)); strides in elements of 2 bytes.
    fn offset(&self, mn: usize, k: usize) -> usize {
        let (w, lbo, sbo) = (self.w, self.lbo, self.sbo);
        let elems = match (self.mn_major, w) {
            (false, 1) => (mn % 8) * 8 + (mn / 8) * (sbo / 2) + (k % 8) + (k / 8) * (lbo / 2),
            (false, _) => (mn % 8) * w * 8 + (mn / 8) * (sbo / 2) + (k % 8) + (k / 8) * 8,
            (true, 1) => (mn % 8) + (mn / 8) * (sbo / 2) + (k % 8) * 8 + (k / 8) * (lbo / 2),
            (true, _) => {
                (mn % 8)
                    + ((mn / 8) % w) * 8
                    + (mn / (8 * w)) * (lbo / 2)
                    + (k % 8) * w * 8
                    + (k / 8) * (sbo / 2)
            }
        };
        2 * elems
    }

    /// A layout for an operand of `mn` rows and `k` columns, strides chosen
    /// so that no two elements meet and LBO and SBO both matter where used.
    fn for_operand(mn_major: bool, w: usize, mn: usize, k: usize) -> Layout {
        match (mn_major, w) {
            // core matrices of 8 x 16 bytes: all MN groups, then the next 8 k
            (_, 1) => Layout { mn_major, w, lbo: 128 * mn.div_ceil(8), sbo: 128 },
            // K-major atoms of 8 rows x 16w bytes stacked along MN
            (false, _) => {
                assert!(k <= 8 * w);
                Layout { mn_major, w, lbo: 16, sbo: 128 * w }
            }
            // MN-major atoms of 8 k-rows x 16w bytes: the k groups, then the next MN atom
            (true, _) => Layout { mn_major, w, lbo: 128 * w * k.div_ceil(8), sbo: 128 * w },
        }
    }

    /// The swizzle mode field of the matrix descriptor.
    fn mode(&self) -> i32 {
        match self.w {
            1 => 0,
            8 => 1,
            4 => 2,
            _ => 3,
        }
    }

    /// The shared-memory image of `value(mn, k)` for mn < `mn`, k < `k`
    /// (16-bit bits), unused bytes a pattern that poisons any sum reading
    /// them.
    fn image(&self, mn: usize, k: usize, value: impl Fn(usize, usize) -> u16) -> Vec<u8> {
        let mut end = 0;
        for i in 0..mn {
            for j in 0..k {
                end = end.max(swizzled(self.offset(i, j), self.w) + 2);
            }
        }
        let mut img = vec![0x47u8; end.next_multiple_of(1024)];
        for i in 0..mn {
            for j in 0..k {
                let o = swizzled(self.offset(i, j), self.w);
                assert_eq!(img[o..o + 2], [0x47, 0x47], "layout {self:?} puts two elements at {o}");
                img[o..o + 2].copy_from_slice(&value(i, j).to_le_bytes());
            }
        }
        img
    }
}

fn a_val(m: usize, k: usize) -> f32 {
    ((m * 7 + k * 3) % 11) as f32 - 5.0
}
fn b_val(k: usize, n: usize) -> f32 {
    ((k * 5 + n * 3) % 13) as f32 - 6.0
}
fn c_val(r: usize, c: usize) -> f32 {
    ((r * 3 + c) % 17) as f32 - 8.0
}

fn to16(v: f32, f16: bool) -> u16 {
    if f16 {
        half::f16::from_f32(v).to_bits()
    } else {
        half::bf16::from_f32(v).to_bits()
    }
}

/// The ISA's accumulator fragment of wgmma m64nNk16: register `i` of thread
/// `t` of the warpgroup holds D(row, col).
fn d_fragment(t: usize, i: usize) -> (usize, usize) {
    let (warp, lane) = (t / 32, t % 32);
    (16 * warp + lane / 4 + 8 * ((i / 2) % 2), 8 * (i / 4) + 2 * (lane % 4) + i % 2)
}

/// The ISA's A fragment of wgmma m64nNk16 (f16/bf16): element `e` (0..8) of
/// thread `t` holds A(row, col); register j packs elements 2j (low) and 2j+1.
fn a_fragment(t: usize, e: usize) -> (usize, usize) {
    let (warp, lane) = (t / 32, t % 32);
    (16 * warp + lane / 4 + 8 * ((e / 2) % 2), 2 * (lane % 4) + e % 2 + 8 * (e / 4))
}

#[derive(Clone, Copy, Debug)]
enum ASource {
    KMajor,
    MMajor,
    Registers,
}

struct WgCase {
    n: usize,
    f16: bool,
    a: ASource,
    b_n_major: bool,
    w: usize,
    accumulate: bool,
    early_read: bool,
}

/// Runs one wgmma and returns (got, want) per thread and register.
fn wgmma_case(c: &WgCase) -> (Vec<f32>, Vec<f32>) {
    let n = c.n;
    let regs = n / 2;
    // K-major swizzled operands hold a whole swizzle row of k; the wgmma reads
    // its last 16 (the descriptor's start 32 bytes further per slice)
    let k_total = |mn_major: bool| if !mn_major && c.w > 2 { 8 * c.w } else { 16 };
    let a_major = matches!(c.a, ASource::MMajor);
    let ka = k_total(a_major);
    let kb = k_total(c.b_n_major);
    let (ks_a, ks_b) = (ka / 16 - 1, kb / 16 - 1);
    let la = Layout::for_operand(a_major, c.w, 64, ka);
    let lb = Layout::for_operand(c.b_n_major, c.w, n, kb);
    let (a_img, a_start) = match c.a {
        ASource::Registers => {
            let mut frag = Vec::with_capacity(128 * 16);
            for t in 0..128 {
                for j in 0..4 {
                    let lo = a_fragment(t, 2 * j);
                    let hi = a_fragment(t, 2 * j + 1);
                    let bits = to16(a_val(lo.0, lo.1), c.f16) as u32
                        | (to16(a_val(hi.0, hi.1), c.f16) as u32) << 16;
                    frag.extend_from_slice(&bits.to_le_bytes());
                }
            }
            (frag, 0)
        }
        _ => {
            let img = la.image(64, ka, |m, k| to16(a_val(m, k), c.f16));
            (img, 32 * ks_a)
        }
    };
    let b_img = lb.image(n, kb, |j, k| to16(b_val(k, j), c.f16));
    let b_at = if matches!(c.a, ASource::Registers) { 0 } else { a_img.len() };
    let cin: Vec<f32> = (0..128 * regs)
        .map(|x| {
            let (r, col) = d_fragment(x / regs, x % regs);
            c_val(r, col)
        })
        .collect();
    let mut out = vec![0f32; 128 * regs];
    let variant = c.f16 as i32
        | (a_major as i32) << 1
        | (c.b_n_major as i32) << 2
        | (matches!(c.a, ASource::Registers) as i32) << 3
        | (match n {
            16 => 0,
            64 => 1,
            128 => 2,
            _ => 3,
        }) << 4;
    let args = WgmmaArgs {
        a: a_img.as_ptr() as DevPtr,
        b: b_img.as_ptr() as DevPtr,
        c: cin.as_ptr() as DevPtr,
        out: out.as_mut_ptr() as DevPtr,
        a_bytes: if matches!(c.a, ASource::Registers) { 0 } else { a_img.len() as u32 },
        b_bytes: b_img.len() as u32,
        b_at: b_at as u32,
        a_start: a_start as u32,
        b_start: 32 * ks_b as u32,
        lbo_a: la.lbo as u32,
        sbo_a: la.sbo as u32,
        lbo_b: lb.lbo as u32,
        sbo_b: lb.sbo as u32,
        mode_a: la.mode(),
        mode_b: lb.mode(),
        variant,
        accumulate: c.accumulate as i32,
        early_read: c.early_read as i32,
    };
    let smem = (b_at + b_img.len() + 1024) as u32;
    run("hopper_wgmma", LaunchConfig::linear(1, 128).with_shared(smem), &args).unwrap();
    let a_k0 = if matches!(c.a, ASource::Registers) { 0 } else { 16 * ks_a };
    let want: Vec<f32> = (0..128 * regs)
        .map(|x| {
            let (r, col) = d_fragment(x / regs, x % regs);
            let dot: f64 =
                (0..16).map(|k| a_val(r, a_k0 + k) as f64 * b_val(16 * ks_b + k, col) as f64).sum();
            (dot + if c.accumulate { c_val(r, col) as f64 } else { 0.0 }) as f32
        })
        .collect();
    (out, want)
}

#[test]
fn wgmma_follows_the_isa_fragments_and_shared_layouts() {
    let mut cases = 0;
    for (wi, w) in [1usize, 2, 4, 8].into_iter().enumerate() {
        for (ai, a) in
            [ASource::KMajor, ASource::MMajor, ASource::Registers].into_iter().enumerate()
        {
            for b_n_major in [false, true] {
                for (ni, n) in [16usize, 64, 128, 256].into_iter().enumerate() {
                    let c = WgCase {
                        n,
                        f16: (wi + ai + ni) % 2 == 1,
                        a,
                        b_n_major,
                        w,
                        accumulate: (wi + ni + b_n_major as usize).is_multiple_of(2),
                        early_read: false,
                    };
                    let (got, want) = wgmma_case(&c);
                    let bad: Vec<String> = (0..got.len())
                        .filter(|&x| got[x] != want[x])
                        .take(4)
                        .map(|x| {
                            let (r, col) = d_fragment(x / (n / 2), x % (n / 2));
                            format!(
                                "thread {} reg {} D[{r}][{col}] = {} want {}",
                                x / (n / 2),
                                x % (n / 2),
                                got[x],
                                want[x]
                            )
                        })
                        .collect();
                    assert!(
                        bad.is_empty(),
                        "N {n} f16 {} A {a:?} B n-major {b_n_major} swizzle {} acc {}: {}",
                        c.f16,
                        16 * w,
                        c.accumulate,
                        bad.join("; ")
                    );
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 96);
}

#[test]
fn wgmma_accumulators_read_before_the_wait_are_nan() {
    let c = WgCase {
        n: 64,
        f16: false,
        a: ASource::KMajor,
        b_n_major: false,
        w: 8,
        accumulate: true,
        early_read: true,
    };
    let (got, want) = wgmma_case(&c);
    for t in 0..128 {
        assert!(got[t * 32].is_nan(), "thread {t} read {} before the wait", got[t * 32]);
        assert_eq!(&got[t * 32 + 1..t * 32 + 32], &want[t * 32 + 1..t * 32 + 32], "thread {t}");
    }
    let mut out = vec![0f32; 1];
    let args = WgmmaArgs { out: out.as_mut_ptr() as DevPtr, ..bytemuck::Zeroable::zeroed() };
    let e = run("hopper_wgmma_no_wait", LaunchConfig::linear(1, 128).with_shared(8192), &args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("never waited"), "{e}");
}

#[test]
fn wgmma_wait_group_retires_the_older_groups_only() {
    let mut out = vec![0f32; 4 * 128];
    let args = WgmmaArgs { out: out.as_mut_ptr() as DevPtr, ..bytemuck::Zeroable::zeroed() };
    run("hopper_wgmma_groups", LaunchConfig::linear(1, 128).with_shared(8192), &args).unwrap();
    for t in 0..128 {
        let o = &out[4 * t..4 * t + 4];
        // every element of A and B is 1: each result is the sum over k = 16
        assert_eq!((o[0], o[2], o[3]), (16.0, 16.0, 16.0), "thread {t}: {o:?}");
        assert!(o[1].is_nan(), "thread {t}: the second group landed before its wait: {o:?}");
    }
}

// ---------------------------------------------------------------- bulk reductions

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct BulkReduceArgs {
    dst: DevPtr,
    src: DevPtr,
    out: DevPtr,
    dst_off: i32,
    src_off: i32,
    bytes: i32,
    mode: i32,
}

/// Runs `hopper_bulk_reduce` (hopper/bulk_reduce.cu) over a destination of
/// 128 floats `100 + i`, 16-byte aligned, and the shared source `i + 0.5`;
/// returns the destination and what the kernel read back.
fn bulk_reduce(
    dst_off: i32,
    src_off: i32,
    bytes: i32,
    mode: i32,
) -> tpar_kernels::Result<(Vec<f32>, Vec<f32>)> {
    let e = emu();
    static ADDED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ADDED.get_or_init(|| {
        e.add_source("hopper_bulk_test", BULK_SRC).expect("the bulk reduction kernels compile")
    });
    let mut dst = vec![0f32; 128 + 4];
    let at = (16 - dst.as_ptr() as usize % 16) % 16 / 4;
    for (i, x) in dst[at..at + 128].iter_mut().enumerate() {
        *x = 100.0 + i as f32;
    }
    let src: Vec<f32> = (0..256).map(|i| i as f32 + 0.5).collect();
    let mut out = vec![0f32; 256];
    let args = BulkReduceArgs {
        dst: dst[at..].as_mut_ptr() as DevPtr,
        src: src.as_ptr() as DevPtr,
        out: out.as_mut_ptr() as DevPtr,
        dst_off,
        src_off,
        bytes,
        mode,
    };
    run("hopper_bulk_reduce", LaunchConfig::linear(1, 32).with_shared(1024), &args)?;
    Ok((dst[at..at + 128].to_vec(), out))
}

#[test]
fn bulk_reduction_adds_exactly_its_size() {
    // 12 floats from shared byte 32 (float 8) into dst[4..16]
    let (dst, _) = bulk_reduce(4, 32, 48, 0).unwrap();
    for (i, &x) in dst.iter().enumerate() {
        let want =
            100.0 + i as f32 + if (4..16).contains(&i) { (i - 4 + 8) as f32 + 0.5 } else { 0.0 };
        assert_eq!(x, want, "dst[{i}]");
    }
}

#[test]
fn bulk_reduction_reads_its_source_when_a_wait_retires_it() {
    if emu().checks_races() {
        // both cases below race on purpose (the source overwritten, the destination
        // read, while a reduction is in flight): TPAR_EMU_RACECHECK=1 names them
        for mode in [1, 2] {
            let err = bulk_reduce(8, 16, 64, mode).unwrap_err().to_string();
            assert!(err.contains("racecheck"), "mode {mode}: {err}");
        }
        return;
    }
    // the source overwritten before wait_group.read: the emulator's read
    // comes at the wait (the latest the ISA allows), so the 1000s arrive
    let (dst, _) = bulk_reduce(0, 0, 32, 1).unwrap();
    for (i, &x) in dst.iter().enumerate() {
        let want = 100.0 + i as f32 + if i < 8 { 1000.0 } else { 0.0 };
        assert_eq!(x, want, "dst[{i}]");
    }
    // wait_group.read 1 retires the older of two groups only
    let (dst, out) = bulk_reduce(8, 16, 64, 2).unwrap();
    for i in 0..16 {
        assert_eq!(out[i], 100.0 + (8 + i) as f32 + (4 + i) as f32 + 0.5, "first group [{i}]");
        assert_eq!(out[16 + i], 100.0 + (24 + i) as f32, "second group [{i}] before its wait");
        assert_eq!(dst[24 + i], 100.0 + (24 + i) as f32 + (20 + i) as f32 + 0.5, "after wait 0");
    }
}

#[test]
fn bulk_reduction_misuse_is_reported() {
    for (dst_off, src_off, bytes, want) in [
        (1, 0, 16, "16-byte aligned"),
        (0, 8, 16, "16-byte aligned"),
        (0, 0, 20, "multiple of 16"),
        (0, 1008, 32, "reaches past"),
    ] {
        let e = bulk_reduce(dst_off, src_off, bytes, 0).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("cp.reduce.async.bulk"), "{e}");
    }
    let e = bulk_reduce(0, 0, 16, 3).unwrap_err().to_string();
    assert!(e.contains("never waited for"), "{e}");
}

// ---------------------------------------------------------------- a GEMM tile

/// C = A * B^T (`n_major` false, B stored N x K) or A * B (B stored K x N),
/// on the emulated TMA + mbarrier + wgmma kernel, against a CPU matmul.
fn gemm_tile(m: usize, n: usize, k: usize, n_major: bool) {
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 + i / k) % 9) as f32 - 4.0).collect();
    let b: Vec<f32> = (0..n * k).map(|i| ((i * 5 + i / 3) % 7) as f32 - 3.0).collect();
    // b[j * k + kk] = B^T(j, kk) = B(kk, j)
    let a16: Vec<u16> = a.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let b16: Vec<u16> = if n_major {
        (0..k * n).map(|i| half::bf16::from_f32(b[(i % n) * k + i / n]).to_bits()).collect()
    } else {
        b.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
    };
    let map = |p: &[u16], cols: usize, rows: usize| {
        TensorMap::encode_tiled_emulated(&TiledDesc {
            dtype: TensorMapDType::BF16,
            global: p.as_ptr() as u64,
            dims: &[cols as u64, rows as u64],
            strides: &[2 * cols as u64],
            box_dims: &[64, 64],
            swizzle: TensorMapSwizzle::B128,
        })
        .unwrap()
    };
    let mut c = vec![f32::NAN; m * n];
    let args = GemmTileArgs {
        map_a: map(&a16, k, m),
        map_b: if n_major { map(&b16, n, k) } else { map(&b16, k, n) },
        c: c.as_mut_ptr() as DevPtr,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        pad: [0; 11],
    };
    let name = if n_major { "hopper_gemm_tile_nn" } else { "hopper_gemm_tile_nt" };
    let cfg = LaunchConfig::grid([n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1], 128)
        .with_shared(2 * 64 * 64 * 2 + 1024);
    run(name, cfg, &args).unwrap();
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k).map(|kk| a[i * k + kk] as f64 * b[j * k + kk] as f64).sum();
            assert_eq!(c[i * n + j] as f64, want, "{name} {m}x{n}x{k}: C[{i}][{j}]");
        }
    }
}

#[test]
fn a_tma_wgmma_gemm_tile_equals_a_cpu_matmul() {
    gemm_tile(64, 64, 64, false);
    gemm_tile(100, 72, 200, false);
    gemm_tile(100, 72, 200, true);
    gemm_tile(128, 64, 72, true);
}

// ---------------------------------------------------------------- clusters

#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ClusterArgs {
    map: TensorMap,
    out: DevPtr,
    bytes: i32,
    mask: i32,
    pad: [i32; 12],
}

fn run_cluster(
    name: &str,
    cfg: LaunchConfig,
    cluster: [u32; 3],
    args: &ClusterArgs,
) -> tpar_kernels::Result<()> {
    // SAFETY: the kernels write `out` within the sizes the tests allocate and
    // read the tensor map's host buffer, both alive across the launch.
    unsafe { emu().launch_cluster_raw(name, &cfg, cluster, bytemuck::bytes_of(args)) }
}

#[test]
fn cluster_blocks_share_memory_barriers_and_mbarriers() {
    for cluster in [2u32, 4] {
        let grid = 8u32;
        let mut out = vec![-1i32; grid as usize * 66];
        let args = ClusterArgs {
            map: TensorMap { opaque: [0; 16] },
            out: out.as_mut_ptr() as DevPtr,
            bytes: 0,
            mask: 0,
            pad: [0; 12],
        };
        let cfg = LaunchConfig::linear(grid, 64).with_shared(2048);
        run_cluster("hopper_cluster_exchange", cfg, [cluster, 1, 1], &args).unwrap();
        for b in 0..grid as usize {
            let rank = b % cluster as usize;
            let next = b - rank + (rank + 1) % cluster as usize;
            for t in 0..64 {
                assert_eq!(
                    out[b * 64 + t],
                    (next * 1000 + t) as i32,
                    "cluster {cluster} block {b} t {t}"
                );
            }
            let at = grid as usize * 64 + 2 * b;
            assert_eq!((out[at], out[at + 1]), (rank as i32, cluster as i32), "block {b}");
        }
    }
    let args =
        ClusterArgs { map: TensorMap { opaque: [0; 16] }, out: 0, bytes: 0, mask: 0, pad: [0; 12] };
    let e = run_cluster("hopper_cluster_exchange", LaunchConfig::linear(6, 64), [4, 1, 1], &args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("divides the grid"), "{e}");
}

#[test]
fn multicast_tma_fills_every_block_of_the_mask() {
    let t = Tensor2::new(2, 64, 16, 128);
    let map = t.map([64, 16], TensorMapSwizzle::B128);
    let bytes = 64 * 16 * 2;
    for (cluster, mask) in [(2u32, 0b11i32), (4, 0b1011)] {
        let mut out = vec![0u8; bytes * cluster as usize];
        let args = ClusterArgs {
            map,
            out: out.as_mut_ptr() as DevPtr,
            bytes: bytes as i32,
            mask,
            pad: [0; 12],
        };
        let cfg = LaunchConfig::linear(cluster, 128).with_shared(bytes as u32 + 2048);
        let r = run_cluster("hopper_cluster_multicast", cfg, [cluster, 1, 1], &args);
        if emu().checks_races() && mask != (1 << cluster) - 1 {
            // a block outside the mask reads shared memory nothing wrote, on purpose:
            // TPAR_EMU_RACECHECK=1 names it
            let err = r.unwrap_err().to_string();
            assert!(err.contains("uninitialized shared memory"), "{err}");
            continue;
        }
        r.unwrap();
        for b in 0..cluster as usize {
            let img = &out[b * bytes..(b + 1) * bytes];
            if mask >> b & 1 == 0 {
                // the emulator's fill of fresh shared memory
                assert!(img.iter().all(|&x| x == 0xA5), "block {b} outside the mask received data");
                continue;
            }
            for r in 0..16 {
                for c in 0..64 {
                    let o = swizzled((r * 64 + c) * 2, 8);
                    assert_eq!(
                        &img[o..o + 2],
                        t.at(r as i64, c as i64).unwrap(),
                        "block {b} ({r}, {c})"
                    );
                }
            }
        }
    }
    let mut out = vec![0u8; bytes * 2];
    let args = ClusterArgs {
        map,
        out: out.as_mut_ptr() as DevPtr,
        bytes: bytes as i32,
        mask: 0b100,
        pad: [0; 12],
    };
    let cfg = LaunchConfig::linear(2, 128).with_shared(bytes as u32 + 2048);
    let e = run_cluster("hopper_cluster_multicast", cfg, [2, 1, 1], &args).unwrap_err().to_string();
    assert!(e.contains("outside the cluster"), "{e}");
}

#[test]
fn multicast_3d_loads_equal_the_plain_3d_load() {
    // a 3 x 20 x 64 bf16 tensor (planes 20 rows of 64, rows 128 bytes apart);
    // boxes of 64 x 16 x 2 with the 128-byte swizzle, partly outside in y and z
    let (cols, rows, planes, pitch) = (64usize, 20usize, 3usize, 128usize);
    let plane = rows * pitch;
    let mut data = vec![0u16; plane / 2 * planes + 64];
    let base = data.as_ptr() as usize;
    let off = (base.next_multiple_of(16) - base) / 2;
    for (i, v) in data[off..].iter_mut().enumerate() {
        *v = (i * 7919 % 65521 + 1) as u16;
    }
    let map = TensorMap::encode_tiled_emulated(&TiledDesc {
        dtype: TensorMapDType::BF16,
        global: data[off..].as_ptr() as u64,
        dims: &[cols as u64, rows as u64, planes as u64],
        strides: &[pitch as u64, plane as u64],
        box_dims: &[64, 16, 2],
        swizzle: TensorMapSwizzle::B128,
    })
    .unwrap();
    let bytes = 64 * 16 * 2 * 2;
    for (cluster, mask, (y, z)) in [(2u32, 0b11, (8, 2)), (4, 0b1101, (-3, 0)), (2, 0b10, (0, 1))] {
        let mut out = vec![0u8; bytes * (cluster as usize + 1)];
        let args = TmaArgs {
            map,
            src: 0,
            out: out.as_mut_ptr() as DevPtr,
            x: 0,
            y,
            bytes: bytes as i32,
            extra_tx: z | (mask << 8),
            pad: [0; 4],
        };
        let cfg = LaunchConfig::linear(cluster, 128)
            .with_shared(2 * bytes as u32 + 2048)
            .with_cluster([cluster, 1, 1]);
        run("hopper_cluster_multicast_3d", cfg, &args).unwrap();
        let plain = &out[cluster as usize * bytes..];
        assert!(plain.iter().any(|&b| b != 0), "the plain load read nothing");
        for b in 0..cluster as usize {
            let img = &out[b * bytes..(b + 1) * bytes];
            if mask >> b & 1 == 1 {
                assert_eq!(img, plain, "cluster {cluster} mask {mask:#b}: block {b}");
            } else {
                assert!(img.iter().all(|&x| x == 0), "block {b} outside the mask wrote out");
            }
        }
    }
}

/// `LaunchConfig::with_cluster` through the ordinary launch path: the
/// emulator runs the blocks as clusters (each sees its rank, the cluster
/// size and its neighbour's shared memory), a graph captured on an emulated
/// device replays them as clusters, and a bad shape is a typed error.
#[test]
fn launch_config_clusters_reach_every_launcher() {
    use tpar_kernels::cuda::emu::EmulatedGpu;
    use tpar_kernels::cuda::graph::CudaGraph;
    use tpar_kernels::KernelError;
    let grid = 8u32;
    let check = |out: &[i32], cluster: u32, what: &str| {
        for b in 0..grid as usize {
            let rank = b % cluster as usize;
            let next = b - rank + (rank + 1) % cluster as usize;
            assert_eq!(out[b * 64 + 5], (next * 1000 + 5) as i32, "{what}: block {b}");
            let at = grid as usize * 64 + 2 * b;
            assert_eq!((out[at], out[at + 1]), (rank as i32, cluster as i32), "{what}: block {b}");
        }
    };
    let fresh = || vec![-1i32; grid as usize * 66];
    let args_for = |out: &mut Vec<i32>| ClusterArgs {
        map: TensorMap { opaque: [0; 16] },
        out: out.as_mut_ptr() as DevPtr,
        bytes: 0,
        mask: 0,
        pad: [0; 12],
    };
    for cluster in [1u32, 2, 4, 8] {
        let mut out = fresh();
        let cfg = LaunchConfig::linear(grid, 64).with_shared(2048).with_cluster([cluster, 1, 1]);
        run("hopper_cluster_exchange", cfg, &args_for(&mut out)).unwrap();
        check(&out, cluster, "Emulator");
    }
    // the emulated device, directly and replayed from a graph
    // (its launches reach its own buffers only: `out` is device memory here)
    let dev = EmulatedGpu::open(0).unwrap();
    emu(); // registers the test kernels with the emulator the device runs
    let mut out = tpar_kernels::cuda::DeviceBuffer::from_host(&dev, &fresh()).unwrap();
    let args = ClusterArgs { out: out.as_slice_mut().ptr(), ..args_for(&mut Vec::new()) };
    let cfg = LaunchConfig::linear(grid, 64).with_shared(2048).with_cluster([2, 1, 1]);
    // SAFETY: as `run`: `out` covers what the kernel writes and outlives the graph.
    let graph = CudaGraph::capture(&dev, || unsafe {
        launch(dev.as_ref(), "hopper_cluster_exchange", cfg, &args)
    })
    .unwrap();
    let ints = |b: &tpar_kernels::cuda::DeviceBuffer| -> Vec<i32> {
        bytemuck::cast_slice(&b.to_host().unwrap()).to_vec()
    };
    assert!(ints(&out).iter().all(|&v| v == -1), "a captured launch ran");
    graph.replay().unwrap();
    check(&ints(&out), 2, "graph replay");
    // refused shapes, before anything runs
    for (grid, cluster, want) in
        [(6, [4, 1, 1], "not a multiple"), (16, [16, 1, 1], "at most 8"), (4, [2, 0, 1], "zero")]
    {
        let cfg = LaunchConfig::linear(grid, 64).with_shared(2048).with_cluster(cluster);
        let mut out = vec![-1i32; grid as usize * 66];
        let e = run("hopper_cluster_exchange", cfg, &args_for(&mut out)).unwrap_err();
        assert!(matches!(e, KernelError::BadCluster { .. }) && e.to_string().contains(want), "{e}");
        assert!(out.iter().all(|&v| v == -1));
        // SAFETY: refused before launching.
        let e = unsafe { dev.launch_raw("hopper_cluster_exchange", &cfg, &[0u8; 1]) }.unwrap_err();
        assert!(matches!(e, KernelError::BadCluster { .. }), "{e}");
    }
}

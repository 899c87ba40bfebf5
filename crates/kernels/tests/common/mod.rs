//! Helpers shared by the emulator tests (`emu/`, `emu_sm90a/`, `emu_*.rs`): host
//! buffers standing in for device memory, deterministic test data and tolerance
//! checks. Each test binary uses a subset of them.
#![allow(dead_code)]

use std::sync::Arc;

use tpar_kernels::cuda::emu::Emulator;
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::cuda::{GpuDevice, LaunchConfig, Launcher, MemorySpace};
use tpar_kernels::Float;
use tpar_kernels::KernelError;

pub mod sdpa;

/// The CPU emulator, built once per test process.
pub fn emu() -> &'static Emulator {
    Emulator::get().expect("the CPU emulator builds")
}

/// The plain emulator (`check` false) or the checking one (`Emulator::racecheck`),
/// with the test's own kernels `src` added once under `name` (once per name and
/// emulator: several test modules of one binary add sources of their own).
pub fn emu_with(check: bool, name: &str, src: &str) -> &'static Emulator {
    static ADDED: std::sync::Mutex<Vec<(bool, String)>> = std::sync::Mutex::new(Vec::new());
    let e =
        if check { Emulator::racecheck().expect("the checking emulator builds") } else { emu() };
    let mut added = ADDED.lock().unwrap_or_else(|p| p.into_inner());
    if !added.iter().any(|(c, n)| *c == check && n == name) {
        e.add_source(name, src).expect("the test kernels compile");
        added.push((check, name.to_string()));
    }
    e
}

/// The address of a buffer the kernel reads.
pub fn ptr<T>(v: &[T]) -> DevPtr {
    v.as_ptr() as DevPtr
}

/// The address of a buffer the kernel writes.
pub fn mptr<T>(v: &mut [T]) -> DevPtr {
    v.as_mut_ptr() as DevPtr
}

/// The CUDA dtype of a float element type.
pub fn dtype<T: Float>() -> CudaDType {
    match T::NAME {
        "f32" => CudaDType::F32,
        "bf16" => CudaDType::BF16,
        "f16" => CudaDType::F16,
        other => panic!("no CUDA dtype for {other}"),
    }
}

/// Relative tolerance (to the largest magnitude compared) per dtype.
pub fn tol<T: Float>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "f16" => 2e-3,
        _ => 1e-2,
    }
}

/// SplitMix64 test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        self.unit() * 2.0 - 1.0
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec<T: Float>(&mut self, n: usize, scale: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform() * scale)).collect()
    }
    /// Uniform in [lo, hi).
    pub fn uniform_in(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    /// `n` values uniform in [lo, hi).
    pub fn vec_in<T: Float>(&mut self, n: usize, lo: f64, hi: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform_in(lo, hi))).collect()
    }
}

/// `n` deterministic xorshift values uniform in [-scale, scale).
pub fn data(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `v` rounded to `T`.
pub fn cvt<T: Float>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

/// `v` widened to f64.
pub fn f64s<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// `|got - want| <= tol * max|want|` elementwise (the maximum over the finite
/// `want`); NaN and infinities must match.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().filter(|v| v.is_finite()).fold(1e-30f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol * scale
        };
        assert!(ok, "{what}[{i}]: got {g}, want {w} (tol {tol} x {scale})");
    }
}

/// [`assert_close`] on elements of `T`, naming the dtype.
pub fn assert_close_t<T: Float>(what: &str, got: &[T], want: &[T], tol: f64) {
    assert_close(&format!("{what} ({})", T::NAME), &f64s(got), &f64s(want), tol);
}

/// A host buffer standing in for device memory: its first element sits
/// `shift` elements past a 16-byte boundary.
pub struct Buf<T> {
    v: Vec<T>,
    off: usize,
    n: usize,
}

impl<T: Copy + Default> Buf<T> {
    pub fn new(data: &[T], shift: usize) -> Self {
        let es = std::mem::size_of::<T>();
        let mut v = vec![T::default(); data.len() + 16 + shift];
        let off = (16 - v.as_ptr() as usize % 16) % 16 / es + shift;
        v[off..off + data.len()].copy_from_slice(data);
        Buf { v, off, n: data.len() }
    }
    pub fn zeros(n: usize, shift: usize) -> Self {
        Buf::new(&vec![T::default(); n], shift)
    }
    pub fn ptr(&mut self) -> DevPtr {
        self.v[self.off..].as_mut_ptr() as DevPtr
    }
    pub fn get(&self) -> Vec<T> {
        self.v[self.off..self.off + self.n].to_vec()
    }
}

/// Tensor lengths for the multi-tensor kernels: an empty tensor, tiny ones, the
/// chunk's edges and more tensors than one launch takes.
pub fn multi_lengths() -> Vec<usize> {
    use tpar_kernels::cuda::raw::multi::{CHUNK, MULTI_MAX};
    let mut lens = vec![0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 1000];
    let mut r = Rng(3);
    while lens.len() < MULTI_MAX + 5 {
        lens.push((r.uniform() * 3000.0) as usize);
    }
    lens
}

/// A device whose memory is host memory but which claims another memory
/// space: its buffers must not reach the emulator's launches.
pub struct Elsewhere(pub Arc<dyn GpuDevice>);

impl Launcher for Elsewhere {
    fn describe(&self) -> String {
        "cuda:1 (elsewhere)".into()
    }

    /// # Safety
    /// As [`Launcher::launch_raw`].
    unsafe fn launch_raw(
        &self,
        kernel: &str,
        cfg: &LaunchConfig,
        args: &[u8],
    ) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee is the emulator's.
        unsafe { self.0.launch_raw(kernel, cfg, args) }
    }
}

// SAFETY: every call forwards to the emulated device, whose memory and order
// it uses; only the memory space it reports differs, which keeps its buffers
// away from other devices' launches.
unsafe impl GpuDevice for Elsewhere {
    fn ordinal(&self) -> usize {
        1
    }
    fn memory_space(&self) -> MemorySpace {
        MemorySpace::Cuda { ordinal: 1, stream: 1 }
    }
    fn alloc(&self, bytes: usize) -> tpar_kernels::Result<u64> {
        self.0.alloc(bytes)
    }
    /// # Safety
    /// As [`GpuDevice::free`].
    unsafe fn free(&self, ptr: u64, bytes: usize) {
        // SAFETY: the caller's guarantee; allocated by the emulated device.
        unsafe { self.0.free(ptr, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::htod`].
    unsafe fn htod(&self, src: &[u8], dst: u64) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.0.htod(src, dst) }
    }
    /// # Safety
    /// As [`GpuDevice::dtoh`].
    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.0.dtoh(src, dst) }
    }
    /// # Safety
    /// As [`GpuDevice::dtod`].
    unsafe fn dtod(&self, src: u64, dst: u64, bytes: usize) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.0.dtod(src, dst, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::copy_from_device`].
    unsafe fn copy_from_device(
        &self,
        src_dev: &dyn GpuDevice,
        src: u64,
        dst: u64,
        bytes: usize,
    ) -> tpar_kernels::Result<()> {
        if src_dev.memory_space() != self.memory_space() {
            return Err(KernelError::WrongDevice {
                op: "copy_from_device",
                what: "source",
                want: self.describe(),
                got: src_dev.describe(),
            });
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.0.dtod(src, dst, bytes) }
    }
    /// # Safety
    /// As [`GpuDevice::zero`].
    unsafe fn zero(&self, dst: u64, bytes: usize) -> tpar_kernels::Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.0.zero(dst, bytes) }
    }
    fn synchronize(&self) -> tpar_kernels::Result<()> {
        self.0.synchronize()
    }
}

/// The bits of `v` rounded to `dt` (in the low 16 bits for bf16 and f16).
pub fn bits_of_value(dt: CudaDType, v: f64) -> u32 {
    match dt {
        CudaDType::BF16 => half::bf16::from_f64(v).to_bits() as u32,
        CudaDType::F16 => half::f16::from_f64(v).to_bits() as u32,
        CudaDType::F32 => (v as f32).to_bits(),
    }
}

/// The value of the bits `b` of `dt` ([`bits_of_value`]'s inverse on `dt`'s values).
pub fn value_of_bits(dt: CudaDType, b: u32) -> f64 {
    match dt {
        CudaDType::BF16 => half::bf16::from_bits(b as u16).to_f64(),
        CudaDType::F16 => half::f16::from_bits(b as u16).to_f64(),
        CudaDType::F32 => f32::from_bits(b) as f64,
    }
}

/// A device buffer in host memory of `len` elements of a [`CudaDType`], read and
/// written as f64: 16-byte aligned, or `shift` bytes past that.
pub struct RawBuf {
    words: Vec<u64>,
    off: usize,
    dt: CudaDType,
    len: usize,
}

impl RawBuf {
    pub fn new(dt: CudaDType, len: usize, shift: usize) -> Self {
        let words = vec![0u64; (len * dt.size()).div_ceil(8) + 4];
        let addr = words.as_ptr() as usize;
        let off = (16 - addr % 16) % 16 + shift;
        RawBuf { words, off, dt, len }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The elements' bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds `off` + `len` elements' bytes.
        unsafe {
            std::slice::from_raw_parts(
                (self.words.as_ptr() as *const u8).add(self.off),
                self.len * self.dt.size(),
            )
        }
    }

    /// The address of a buffer a kernel reads.
    pub fn ptr(&self) -> DevPtr {
        self.words.as_ptr() as DevPtr + self.off as DevPtr
    }

    /// The address of a buffer a kernel writes.
    pub fn mut_ptr(&mut self) -> DevPtr {
        self.words.as_mut_ptr() as DevPtr + self.off as DevPtr
    }

    pub fn bits(&self, i: usize) -> u32 {
        assert!(i < self.len);
        // SAFETY: in bounds of `words` (allocated with room for `off` + `len` elements).
        unsafe {
            let p = (self.words.as_ptr() as *const u8).add(self.off + i * self.dt.size());
            match self.dt.size() {
                2 => (p as *const u16).read_unaligned() as u32,
                _ => (p as *const u32).read_unaligned(),
            }
        }
    }

    pub fn set_bits(&mut self, i: usize, bits: u32) {
        assert!(i < self.len);
        // SAFETY: as in `bits`.
        unsafe {
            let p = (self.words.as_mut_ptr() as *mut u8).add(self.off + i * self.dt.size());
            match self.dt.size() {
                2 => (p as *mut u16).write_unaligned(bits as u16),
                _ => (p as *mut u32).write_unaligned(bits),
            }
        }
    }

    pub fn get(&self, i: usize) -> f64 {
        value_of_bits(self.dt, self.bits(i))
    }

    /// Stores `v` rounded to the buffer's type.
    pub fn set(&mut self, i: usize, v: f64) {
        self.set_bits(i, bits_of_value(self.dt, v));
    }

    /// Values k/16 for k in -16..16 (exact in every type), from `seed`.
    pub fn fill(&mut self, seed: u64) {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for i in 0..self.len {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            self.set(i, ((s >> 40) % 32) as f64 / 16.0 - 1.0);
        }
    }
}

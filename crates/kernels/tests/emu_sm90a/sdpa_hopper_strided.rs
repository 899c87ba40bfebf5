//! The Hopper attention kernels (`cuda/sdpa_hopper.cu`,
//! `cuda/sdpa_hopper_bwd.cu`) on strided operands, run in the CPU emulator
//! as `sm_90a`: q, k and v read through their element strides as separate
//! `[b, s, h, hd]` buffers or packed in one `[b, s, (hq + 2 hkv) hd]`
//! projection output; out, dout, dq, dk and dv in the rows of wider buffers
//! whose other elements hold a guard value that must survive. Every result
//! must equal, bit for bit, the same kernels on dense `[b, h, s, hd]` copies
//! (which are checked against the f64 reference): bf16 and f16, head dims 64
//! and 128, GQA, causal or not, a key-padding mask, two batches of 130 rows
//! (the last q and key tiles of a batch end mid-tile). Strides a tensor map
//! cannot take are refused by name.

use crate::common;

use common::sdpa::{
    max_rel, same_dim_shape as shape, Inputs, MaskKind, MaskPlan, Placed, Workspace,
};
use common::{emu, f64s};
use half::{bf16, f16};
use tpar_kernels::cuda::raw::sdpa::{SdpaBwdBuffers, SdpaFwdBuffers, SdpaLayout, SdpaStrides};
use tpar_kernels::cuda::raw::sdpa_hopper::{self, EMU_ARCH_ENV};
use tpar_kernels::cuda::raw::sdpa_hopper_bwd;
use tpar_kernels::cuda::{CudaDType, DevPtr};
use tpar_kernels::sdpa::SdpaShape;
use tpar_kernels::{Float, KernelError};

/// Batch `b` keeps `kv_len - 37b - 5` keys (the second batch's padding
/// crosses a key tile's edge at 130 keys).
const MASKS: MaskPlan = MaskPlan { pad_step: 37, pad_base: 5, row_step: 37 };

/// Rows (of the widest place) of guards every buffer holds past its last
/// operand element: room for a kernel that writes the rows of a whole tile
/// past a length.
const TAIL_ROWS: usize = 64;

/// The 16-bit attention types, compared by their bits.
trait Half: Float {
    const DTYPE: CudaDType;
    /// What every element of a buffer that no operand covers holds.
    const GUARD: u16;
    fn bits(self) -> u16;
    fn of_bits(b: u16) -> Self;
}

impl Half for bf16 {
    const DTYPE: CudaDType = CudaDType::BF16;
    const GUARD: u16 = 0x4b5a; // 1.43e7
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of_bits(b: u16) -> Self {
        bf16::from_bits(b)
    }
}

impl Half for f16 {
    const DTYPE: CudaDType = CudaDType::F16;
    const GUARD: u16 = 0x7a5b; // 52064
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn of_bits(b: u16) -> Self {
        f16::from_bits(b)
    }
}

/// A host buffer standing in for device memory: 16-byte aligned, every
/// element [`Half::GUARD`] until an operand is put in or a kernel writes.
struct Region<T> {
    v: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Half> Region<T> {
    /// Room for the `places` (and [`TAIL_ROWS`] rows of guards after them).
    fn new(places: &[Placed]) -> Self {
        let row = places.iter().map(|p| p.st.row).max().unwrap_or(0);
        let len = places.iter().map(Placed::end).max().unwrap_or(0) + TAIL_ROWS * row;
        let v = vec![T::of_bits(T::GUARD); len + 8];
        let off = (16 - v.as_ptr() as usize % 16) % 16 / 2;
        Region { v, off, len }
    }

    /// The address of element `at`.
    fn addr(&mut self, at: usize) -> DevPtr {
        self.v[self.off + at..].as_mut_ptr() as DevPtr
    }

    /// `dense` (`[b, h, len, dim]`) into the elements of `p`.
    fn put(&mut self, p: &Placed, dense: &[T]) {
        for (i, x) in p.offsets().zip(dense) {
            self.v[self.off + i] = *x;
        }
    }

    /// The elements of `p`, dense.
    fn take(&self, p: &Placed) -> Vec<T> {
        p.offsets().map(|i| self.v[self.off + i]).collect()
    }

    /// The elements no place of `covered` holds that lost their guard value.
    fn spoiled(&self, covered: &[Placed]) -> Vec<usize> {
        let mut mine = vec![false; self.len];
        for p in covered {
            for i in p.offsets() {
                mine[i] = true;
            }
        }
        (0..self.len).filter(|&i| !mine[i] && self.v[self.off + i].bits() != T::GUARD).collect()
    }
}

/// How q, k and v (and so dq, dk and dv) lie, and out and dout.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Each dense `[b, h, len, hd]` in its own buffer, passed without strides
    /// (`SdpaLayout::default()`): the baseline.
    Dense,
    /// Each in its own `[b, len, h hd + 2 pad]` buffer from column `pad`.
    Separate { pad: usize },
    /// One `[b, s, (hq + 2 hkv) hd + pad]` buffer: q, then k, then v.
    Packed { pad: usize },
}

/// Where a case's operands lie: q, k, v and out, the buffer each of q, k
/// and v is in (out and dout have their own), and what the kernels are told.
struct Places {
    p: [Placed; 4],
    of: [usize; 3],
    layout: SdpaLayout,
}

/// The dense place of an operand `dims`.
fn dense(dims: [usize; 4]) -> Placed {
    Placed { off: 0, st: SdpaStrides::contiguous(dims[1], dims[2], dims[3]), dims }
}

fn places(s: &SdpaShape, layout: Layout) -> Places {
    let hd = s.head_dim;
    let qd = [s.batch, s.q_heads, s.q_len, hd];
    let kd = [s.batch, s.kv_heads, s.kv_len, hd];
    let rows = |p: usize, dims: [usize; 4]| {
        let st = SdpaStrides::bshd(dims[2], dims[1] * hd + 2 * p, hd);
        Placed { off: p, st, dims }
    };
    let strided = |p: [Placed; 4], of| Places {
        p,
        of,
        layout: SdpaLayout {
            q: Some(p[0].st),
            k: Some(p[1].st),
            v: Some(p[2].st),
            out: Some(p[3].st),
        },
    };
    match layout {
        Layout::Dense => Places {
            p: [dense(qd), dense(kd), dense(kd), dense(qd)],
            of: [0, 1, 2],
            layout: SdpaLayout::default(),
        },
        Layout::Separate { pad } => {
            strided([rows(pad, qd), rows(pad, kd), rows(pad, kd), rows(pad, qd)], [0, 1, 2])
        }
        Layout::Packed { pad } => {
            assert_eq!(s.q_len, s.kv_len, "a packed projection has one length");
            let st = SdpaStrides::bshd(s.q_len, (s.q_heads + 2 * s.kv_heads) * hd + pad, hd);
            let at = |heads: usize| Placed { off: heads * hd, st, dims: kd };
            let q = Placed { dims: qd, ..at(0) };
            strided([q, at(s.q_heads), at(s.q_heads + s.kv_heads), rows(pad, qd)], [0, 0, 0])
        }
    }
}

/// The buffers of q, k and v (one or three) with `data` put in their places.
fn qkv_regions<T: Half>(pl: &Places, data: [Option<&[T]>; 3]) -> Vec<Region<T>> {
    let n = pl.of.iter().max().unwrap() + 1;
    let mut regions: Vec<Region<T>> = (0..n).map(|r| Region::new(&pl.in_region(r))).collect();
    for (i, d) in data.into_iter().enumerate() {
        if let Some(d) = d {
            regions[pl.of[i]].put(&pl.p[i], d);
        }
    }
    regions
}

impl Places {
    /// The places of q, k and v in buffer `r`.
    fn in_region(&self, r: usize) -> Vec<Placed> {
        (0..3).filter(|&i| self.of[i] == r).map(|i| self.p[i]).collect()
    }
}

fn bits<T: Half>(v: &[T]) -> Vec<u16> {
    v.iter().map(|x| x.bits()).collect()
}

/// Asserts `got` has the bits of `want`, naming the first difference.
fn same_bits<T: Half>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want[i].bits()) {
        let n = got.iter().zip(want).filter(|(a, b)| a.bits() != b.bits()).count();
        panic!(
            "{what}: {n} of {} elements differ; the first at dense index {i}: {:?} (bits {:#06x}) \
             instead of {:?} ({:#06x})",
            got.len(),
            got[i],
            got[i].bits(),
            want[i],
            want[i].bits()
        );
    }
}

/// What one layout's run produced, dense: out, lse, dq, dk, dv.
struct Results<T> {
    out: Vec<T>,
    lse: Vec<f32>,
    grads: [Vec<T>; 3],
}

/// The Hopper forward, then backward, of `x` laid out as `layout`; asserts
/// that no guard was touched and the inputs are unchanged.
fn run<T: Half>(s: &SdpaShape, x: &Inputs<T>, layout: Layout, what: &str) -> Results<T> {
    let (emu, dt) = (emu(), T::DTYPE);
    let what = format!("{what}, {layout:?}");
    let pl = places(s, layout);
    let (p, of) = (pl.p, pl.of);
    let mut inputs = qkv_regions::<T>(&pl, [Some(&x.q), Some(&x.k), Some(&x.v)]);
    let before: Vec<Vec<u16>> = inputs.iter().map(|r| bits(&r.v)).collect();
    let mut o_reg = Region::<T>::new(&p[3..]);
    let mut lse = vec![7.0f32; s.batch * s.q_heads * s.q_len];
    let fb = SdpaFwdBuffers {
        q: inputs[of[0]].addr(p[0].off),
        k: inputs[of[1]].addr(p[1].off),
        v: inputs[of[2]].addr(p[2].off),
        mask: x.dev_mask(),
        out: o_reg.addr(p[3].off),
        lse: lse.as_mut_ptr() as DevPtr,
        layout: pl.layout,
    };
    assert_eq!(sdpa_hopper::unsupported(emu, dt, s, &fb), None, "{what}");
    // SAFETY: host buffers stand in for device memory (the emulator runs the
    // kernels on this thread before returning), each holding every element
    // the call's sizes and strides reach.
    unsafe { sdpa_hopper::sdpa_forward(emu, dt, s, &fb).unwrap() };
    assert_eq!(o_reg.spoiled(&p[3..]), Vec::<usize>::new(), "guards of out, {what}");
    let out = o_reg.take(&p[3]);

    let mut do_reg = Region::<T>::new(&p[3..]);
    do_reg.put(&p[3], &x.dout);
    let mut grads = qkv_regions::<T>(&pl, [None, None, None]);
    let mut ws = Workspace::new(s);
    let bb = SdpaBwdBuffers {
        q: fb.q,
        k: fb.k,
        v: fb.v,
        mask: x.dev_mask(),
        out: fb.out,
        lse: lse.as_ptr() as DevPtr,
        dout: do_reg.addr(p[3].off),
        dq: grads[of[0]].addr(p[0].off),
        dk: grads[of[1]].addr(p[1].off),
        dv: grads[of[2]].addr(p[2].off),
        workspace: ws.ptr(),
        workspace_bytes: ws.bytes,
        layout: pl.layout,
    };
    assert_eq!(sdpa_hopper_bwd::unsupported(emu, dt, s, &bb), None, "{what}");
    // SAFETY: as above.
    unsafe { sdpa_hopper_bwd::sdpa_backward(emu, dt, s, &bb).unwrap() };
    assert!(ws.guard_intact(), "{what}: the backward wrote past its workspace");
    for (r, reg) in grads.iter().enumerate() {
        let spoiled = reg.spoiled(&pl.in_region(r));
        assert_eq!(spoiled, Vec::<usize>::new(), "guards of gradient buffer {r}, {what}");
    }
    for (r, reg) in inputs.iter().enumerate() {
        assert!(bits(&reg.v) == before[r], "{what}: input buffer {r} changed");
    }
    for (name, reg, want) in [("out", &o_reg, &out), ("dout", &do_reg, &x.dout)] {
        assert!(bits(&reg.take(&p[3])) == bits(want), "{what}: the backward changed {name}");
        assert_eq!(reg.spoiled(&p[3..]), Vec::<usize>::new(), "{name}'s buffer, {what}");
    }
    let grads = [0, 1, 2].map(|i| grads[of[i]].take(&p[i]));
    Results { out, lse, grads }
}

/// Hopper forward and backward of `s` on dense operands (checked against
/// the f64 reference) and on `layout`: every result bit-identical.
fn case<T: Half>(s: SdpaShape, mask: MaskKind, layout: Layout) {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let dt = T::DTYPE;
    let what = format!("{dt:?} {s:?} mask {mask:?}");
    let x = Inputs::<T>::new(&s, mask, MASKS);
    let base = run(&s, &x, Layout::Dense, &what);
    // the baseline against the f64 reference (a fault that strikes every
    // layout alike shows here)
    let tol = if dt == CudaDType::BF16 { 1e-2 } else { 2e-3 };
    let (out_ref, _) = x.reference_forward(&s);
    let (dq_ref, dk_ref, dv_ref) = x.reference_backward(&s);
    let names = ["dq", "dk", "dv"];
    let wants = [&out_ref, &dq_ref, &dk_ref, &dv_ref];
    for (i, (name, want)) in ["out"].iter().chain(&names).zip(wants).enumerate() {
        let got = if i == 0 { &base.out } else { &base.grads[i - 1] };
        let e = max_rel(&format!("dense {name} {what}"), &f64s(got), want);
        assert!(e <= tol, "dense {name} {what}: rel err vs f64 {e:e} > {tol:e}");
    }

    let got = run(&s, &x, layout, &what);
    let what = format!("{what} {layout:?}");
    same_bits(&format!("out {what}"), &got.out, &base.out);
    let lse_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(lse_bits(&got.lse), lse_bits(&base.lse), "lse {what}");
    for (name, (g, b)) in names.iter().zip(got.grads.iter().zip(&base.grads)) {
        same_bits(&format!("{name} {what}"), g, b);
    }
}

/// GQA 4:2, two batches of 130 rows (a whole and a partial tile each).
fn gqa(head_dim: usize, causal: bool) -> SdpaShape {
    shape(2, 4, 2, 130, 130, head_dim, causal)
}

#[test]
fn bf16_d64_packed_causal() {
    case::<bf16>(gqa(64, true), MaskKind::None, Layout::Packed { pad: 0 });
}

#[test]
fn f16_d64_separate_key_padding() {
    case::<f16>(gqa(64, false), MaskKind::KeyPadding, Layout::Separate { pad: 64 });
}

#[test]
fn bf16_d128_separate_causal_key_padding() {
    case::<bf16>(gqa(128, true), MaskKind::KeyPadding, Layout::Separate { pad: 8 });
}

#[test]
fn f16_d128_packed_wide_rows() {
    case::<f16>(gqa(128, false), MaskKind::KeyPadding, Layout::Packed { pad: 64 });
}

#[test]
fn separate_lengths_differ() {
    // More keys than queries and the other way round, each over several tiles.
    case::<bf16>(
        shape(2, 4, 2, 70, 200, 64, true),
        MaskKind::KeyPadding,
        Layout::Separate { pad: 16 },
    );
    case::<f16>(shape(1, 4, 2, 200, 130, 128, false), MaskKind::None, Layout::Separate { pad: 0 });
}

/// Strides that are not multiples of 16 bytes are refused by name: each
/// operand in turn with its row or head stride 4 elements (8 bytes) off, by
/// both kernels' `unsupported` and their launchers (before any launch).
#[test]
fn strides_off_16_bytes_are_refused() {
    std::env::set_var(EMU_ARCH_ENV, "sm_90a");
    let (emu, dt) = (emu(), CudaDType::BF16);
    let s = gqa(64, false);
    let pl = places(&s, Layout::Separate { pad: 8 });
    let (p, of) = (pl.p, pl.of);
    let mut regions = qkv_regions::<bf16>(&pl, [None, None, None]);
    let mut o_reg = Region::<bf16>::new(&p[3..]);
    let mut lse = vec![0.0f32; s.batch * s.q_heads * s.q_len];
    let mut ws = Workspace::new(&s);
    for (name, which) in [("q", "row"), ("k", "head"), ("v", "row"), ("out", "head")] {
        let mut layout = pl.layout;
        let slot = match name {
            "q" => &mut layout.q,
            "k" => &mut layout.k,
            "v" => &mut layout.v,
            _ => &mut layout.out,
        };
        let st = slot.unwrap();
        // wider rows or heads, the outer strides grown so that nothing overlaps
        *slot = Some(if which == "row" {
            SdpaStrides { row: st.row + 4, batch: 2 * st.batch, ..st }
        } else {
            SdpaStrides { head: st.head + 4, row: 2 * st.row, batch: 4 * st.batch }
        });
        let fb = SdpaFwdBuffers {
            q: regions[of[0]].addr(p[0].off),
            k: regions[of[1]].addr(p[1].off),
            v: regions[of[2]].addr(p[2].off),
            mask: None,
            out: o_reg.addr(p[3].off),
            lse: lse.as_mut_ptr() as DevPtr,
            layout,
        };
        let bb = SdpaBwdBuffers {
            q: fb.q,
            k: fb.k,
            v: fb.v,
            mask: None,
            out: fb.out,
            lse: fb.lse,
            dout: fb.out,
            dq: fb.q,
            dk: fb.k,
            dv: fb.v,
            workspace: ws.ptr(),
            workspace_bytes: ws.bytes,
            layout,
        };
        let named = |what: &str, why: Option<String>| {
            let why = why.unwrap_or_else(|| panic!("{what}: {name}'s {which} stride was taken"));
            let needle = format!("{name}'s {which} stride");
            assert!(why.contains(&needle), "{what}: {why:?} does not name {needle:?}");
        };
        named("forward", sdpa_hopper::unsupported(emu, dt, &s, &fb));
        named("backward", sdpa_hopper_bwd::unsupported(emu, dt, &s, &bb));
        let refused = |r: Result<(), KernelError>| match r {
            Err(KernelError::BadArguments { what, .. }) => Some(what),
            other => panic!("{name}: expected a refusal, got {other:?}"),
        };
        // SAFETY: refused before any launch.
        named("forward launch", refused(unsafe { sdpa_hopper::sdpa_forward(emu, dt, &s, &fb) }));
        // SAFETY: as above.
        let r = unsafe { sdpa_hopper_bwd::sdpa_backward(emu, dt, &s, &bb) };
        named("backward launch", refused(r));
    }
}

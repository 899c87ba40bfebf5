//! The Hopper attention's checks (part of the `sdpa` family), where the
//! device runs `sm_90a` kernels: a GPU whose kernels are compiled for
//! `sm_90a`, or the emulator with `TPAR_EMU_ARCH=sm_90a`. Forward
//! (`SdpaPath::Hopper`: `cuda/sdpa_hopper.cu`) and backward on the same path
//! (the Hopper backward where it takes the call) against the f64 CPU
//! kernels: bf16 and f16, head dims 64 and 128, causal or not, GQA, a
//! key-padding mask, ragged lengths; on a GPU, training-sized shapes.

use tpar_kernels::cuda::raw::sdpa::SdpaPath;
use tpar_kernels::cuda::raw::sdpa_hopper::{self, EMU_ARCH_ENV};
use tpar_kernels::cuda::CudaDType;
use tpar_kernels::sdpa::SdpaShape;

use CudaDType::{BF16, F16};

use super::sdpa::{sdpa_label, sdpa_shape, train_case};
use super::Ctx;

pub(crate) fn check_sdpa_hopper(c: &mut Ctx) {
    if sdpa_hopper::target_of(c.d.l()).is_none() {
        println!(
            "   sdpa_hopper: skipped (the device does not run sm_90a kernels; in the emulator \
             set {EMU_ARCH_ENV}=sm_90a)"
        );
        return;
    }
    if c.quick {
        // several q tiles and key tiles, ragged, GQA, causal
        hopper_case(c, BF16, sdpa_shape(1, 4, 2, 130, 200, 64, true), false);
        hopper_case(c, F16, sdpa_shape(1, 2, 1, 70, 150, 128, false), true);
        hopper_case(c, BF16, sdpa_shape(2, 2, 2, 100, 140, 128, true), true);
        hopper_case(c, F16, sdpa_shape(1, 2, 1, 140, 130, 64, true), false);
        // q, k and v in one packed projection output, dq, dk and dv into one gradient
        packed_case(c, BF16, sdpa_shape(2, 4, 2, 130, 130, 64, true));
        packed_case(c, F16, sdpa_shape(1, 2, 1, 100, 100, 128, false));
    } else {
        for dt in [BF16, F16] {
            hopper_case(c, dt, sdpa_shape(2, 32, 8, 1024, 1024, 128, true), false);
        }
        hopper_case(c, BF16, sdpa_shape(4, 16, 4, 1024, 1024, 64, true), false);
        hopper_case(c, BF16, sdpa_shape(2, 8, 8, 300, 1000, 128, false), true);
        hopper_case(c, F16, sdpa_shape(1, 8, 2, 2000, 2000, 128, true), true);
        // the training step's attention with fused projections
        packed_case(c, BF16, sdpa_shape(8, 16, 8, 1024, 1024, 64, true));
    }
}

/// A Hopper case on the packed layout (rows `sdpa_hopper.packed.*`).
fn packed_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape) {
    train_case(c, "sdpa_hopper.packed", &sdpa_label(&s), dt, s, SdpaPath::Hopper, None, true);
}

/// A `[batch, 1, 1, kv_len]` key-padding mask: batch `b` keeps all but its
/// last `37 b + 5` keys (at least one).
fn key_padding(s: &SdpaShape) -> Vec<f64> {
    let mut m = vec![0.0; s.batch * s.kv_len];
    for b in 0..s.batch {
        let keep = s.kv_len.saturating_sub(37 * b + 5).max(1);
        m[b * s.kv_len + keep..(b + 1) * s.kv_len].fill(f64::NEG_INFINITY);
    }
    m
}

fn hopper_case(c: &mut Ctx, dt: CudaDType, s: SdpaShape, padded: bool) {
    let shape = format!("{}{}", sdpa_label(&s), if padded { " key-padding" } else { "" });
    let mask = padded.then(|| key_padding(&s));
    train_case(c, "sdpa_hopper", &shape, dt, s, SdpaPath::Hopper, mask, false);
}

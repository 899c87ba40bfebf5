//! Point-to-point transfers of agreed shape ([`ProcessGroup::send_shaped`] and
//! [`ProcessGroup::recv_shaped`]): what a receiver expects, and the check of what arrived
//! where the tensor itself travels (the local backend, and an NCCL member sending to
//! itself).
//!
//! [`ProcessGroup::send_shaped`]: crate::ProcessGroup::send_shaped
//! [`ProcessGroup::recv_shaped`]: crate::ProcessGroup::recv_shaped

use tpar_tensor::{DType, Device, Tensor};

use crate::{CollectiveError, Result};

/// What a `recv_shaped` caller expects: dims, dtype, and whether it asked for a meta
/// tensor (which carries no data, so its sender must send a meta tensor too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Expect {
    pub dims: Vec<usize>,
    pub dtype: DType,
    pub meta: bool,
}

impl Expect {
    /// The expectation of `recv_shaped(src, dims, dtype, device)`; fails when the dims'
    /// product overflows.
    pub fn new(op: &'static str, dims: &[usize], dtype: DType, device: Device) -> Result<Expect> {
        dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| {
            CollectiveError::InvalidArgument {
                op,
                why: format!("dims {dims:?} have more elements than a tensor can hold"),
            }
        })?;
        Ok(Expect { dims: dims.to_vec(), dtype, meta: device == Device::Meta })
    }

    /// Elements of the expected tensor.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// `"f32 [2, 3]"`, with `" on meta"` for a meta tensor.
    pub fn describe(&self) -> String {
        describe(self.dtype, &self.dims, self.meta)
    }
}

fn describe(dtype: DType, dims: &[usize], meta: bool) -> String {
    let on = if meta { " on meta" } else { "" };
    format!("{dtype} {dims:?}{on}")
}

/// One point-to-point message as it travels where tensors travel whole.
pub(crate) struct Mail {
    /// The sender's private copy.
    pub tensor: Tensor,
    /// Whether `send_shaped` sent it (else `send`).
    pub shaped: bool,
}

/// Checks a message that travelled as a tensor against its receiver's call: `expect` is
/// `None` for `recv` (which pairs with `send`) and the expectation for `recv_shaped`
/// (which pairs with `send_shaped`, with the same dims, dtype and meta-ness).
///
/// `group` holds the members' global ranks; `src` and `me` are member indices. A
/// disagreement is a [`CollectiveError::Mismatch`] that blames the sender and names the
/// receiver, with both sides' descriptions.
pub(crate) fn check_arrival(
    op: &'static str,
    group: &[usize],
    src: usize,
    me: usize,
    mail: &Mail,
    expect: Option<&Expect>,
) -> Result<()> {
    let global = |m: usize| group.get(m).copied().unwrap_or(m);
    let (from, to) = (global(src), global(me));
    let t = &mail.tensor;
    let sent = describe(t.dtype(), t.dims(), t.device() == Device::Meta);
    let mismatch = |expected: String, got: String| CollectiveError::Mismatch {
        op,
        group: group.to_vec(),
        rank: from,
        expected,
        got,
    };
    match (expect, mail.shaped) {
        (None, false) => Ok(()),
        (None, true) => Err(mismatch(
            format!("a tensor from send (what recv on rank {to} pairs with)"),
            format!("{sent} through send_shaped to rank {to} (send_shaped pairs with recv_shaped)"),
        )),
        (Some(e), false) => Err(mismatch(
            format!("{} from send_shaped (what recv_shaped on rank {to} expects)", e.describe()),
            format!("{sent} through send to rank {to} (send pairs with recv)"),
        )),
        (Some(e), true) => {
            let same = t.dims() == e.dims.as_slice()
                && t.dtype() == e.dtype
                && (t.device() == Device::Meta) == e.meta;
            if same {
                Ok(())
            } else {
                Err(mismatch(
                    format!("{} (what recv_shaped on rank {to} expects)", e.describe()),
                    format!("{sent} through send_shaped to rank {to}"),
                ))
            }
        }
    }
}

/// Moves a received tensor to the device its receiver asked for (a meta tensor stays
/// meta: a meta request receives one, and `check_arrival` refused the other cases).
pub(crate) fn to_requested(op: &'static str, t: Tensor, device: Device) -> Result<Tensor> {
    if t.device() == device {
        return Ok(t);
    }
    t.to_device(device).map_err(|e| CollectiveError::InvalidArgument {
        op,
        why: format!("moving the received {} tensor to {device}: {e}", t.device()),
    })
}

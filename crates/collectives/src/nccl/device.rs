//! The real transport: one NCCL communicator and one CUDA stream, owned by the group's
//! worker thread (`nccl::Comm` is not `Send`).
//!
//! Two data paths. The host path (host tensors, and CUDA tensors staged through the host
//! for the calls the device path does not take): [`Transport::run`] copies each host
//! buffer to the device, runs the primitive with [`NcclDevice::run_on_device`] and copies
//! the result back. The device path (`Transport::run_device`, see `ondevice.rs`): NCCL
//! works on the CUDA tensors' own memory, and the worker only enqueues.
//!
//! Waiting: after enqueueing, the worker records an event and polls it (spinning briefly,
//! then sleeping with backoff) until it completes or the call's deadline passes. NCCL gives
//! no other way to bound a collective whose peer never comes: a blocking synchronize
//! would hang for good. On a timeout the worker aborts the communicator
//! (`ncclCommAbort`, which makes the stuck kernels exit), and the group fails from then on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::Comm;

use tpar_tensor::DType;

use super::ondevice::{Borrowed, DeviceEvent, DeviceJob};
use crate::remote::exec::{Deadline, Transport, Wire};
use crate::remote::plan::Prim;
use crate::{CollectiveError, ReduceOp, Result};

/// NCCL's name, code and text for an error.
pub(crate) fn nccl_error_text(e: &NcclError) -> String {
    let code = e.0 as u32;
    let text = super::probe::guarded(|| {
        // SAFETY: `ncclGetErrorString` returns a pointer to a static NUL-terminated string
        // for every result code (or null, checked before reading).
        let p = unsafe { cudarc::nccl::sys::ncclGetErrorString(e.0) };
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, static and NUL-terminated, as above.
            unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    })
    .unwrap_or_default();
    if text.is_empty() {
        format!("{:?} (code {code})", e.0)
    } else {
        format!("{:?} (code {code}): {text}", e.0)
    }
}

/// The CUDA driver's name, code and text for an error.
pub(crate) fn driver_error_text(e: &DriverError) -> String {
    let code = e.0 as u32;
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).ok();
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).ok();
    match (name, text) {
        (Some(n), Some(t)) => format!("{n} (code {code}): {t}"),
        (Some(n), None) => format!("{n} (code {code})"),
        _ => format!("{:?} (code {code})", e.0),
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
        ReduceOp::Product => cudarc::nccl::ReduceOp::Prod,
    }
}

/// The element types NCCL and the device copies take: the [`Wire`] types, with cudarc's
/// traits (the host path reaches them by dispatching on [`Wire`]'s dtype).
pub(crate) trait DeviceWire:
    Wire + cudarc::nccl::NcclType + DeviceRepr + ValidAsZeroBits
{
}

impl<T> DeviceWire for T where T: Wire + cudarc::nccl::NcclType + DeviceRepr + ValidAsZeroBits {}

/// A device collective in flight: its completion event, sequence number, deadline, name.
type InFlight = (Arc<DeviceEvent>, u64, Deadline, &'static str);

/// One group's communicator and stream.
pub(crate) struct NcclDevice {
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    group: Arc<[usize]>,
    me: usize,
    /// Device collectives enqueued and not yet seen complete.
    in_flight: Vec<InFlight>,
}

impl NcclDevice {
    /// Wraps a communicator created on `stream` for member `me` of `group`.
    pub fn new(comm: Comm, stream: Arc<CudaStream>, group: Arc<[usize]>, me: usize) -> NcclDevice {
        NcclDevice { comm: Some(comm), stream, group, me, in_flight: Vec::new() }
    }

    /// Enqueues `job`'s NCCL call on device memory, typed as `T`.
    fn enqueue<T: cudarc::nccl::NcclType>(&self, comm: &Comm, job: &DeviceJob) -> Result<()> {
        let n = self.group.len();
        let buf = |ptr: u64, len: usize| Borrowed::<T> {
            ptr,
            len,
            stream: self.stream.clone(),
            _t: std::marker::PhantomData,
        };
        let nerr = self.nccl_err(job.op);
        match job.prim {
            Prim::AllReduce(rop) => comm.all_reduce(
                &buf(job.send, job.count),
                &mut buf(job.recv, job.count),
                &nccl_op(rop),
            ),
            Prim::AllGather => {
                comm.all_gather(&buf(job.send, job.count), &mut buf(job.recv, n * job.count))
            }
            Prim::ReduceScatter(rop) => comm.reduce_scatter(
                &buf(job.send, n * job.count),
                &mut buf(job.recv, job.count),
                &nccl_op(rop),
            ),
            _ => {
                return Err(
                    self.backend_err(job.op, "internal error: not a device-path primitive".into())
                )
            }
        }
        .map(|_| ())
        .map_err(nerr)
    }

    fn global(&self) -> usize {
        self.group.get(self.me).copied().unwrap_or(self.me)
    }

    fn backend_err(&self, op: &'static str, message: String) -> CollectiveError {
        CollectiveError::Backend {
            backend: "nccl",
            op,
            group: self.group.to_vec(),
            rank: self.global(),
            message,
        }
    }

    fn nccl_err(&self, op: &'static str) -> impl Fn(NcclError) -> CollectiveError + '_ {
        move |e| self.backend_err(op, nccl_error_text(&e))
    }

    fn driver_err(&self, op: &'static str) -> impl Fn(DriverError) -> CollectiveError + '_ {
        move |e| self.backend_err(op, format!("CUDA: {}", driver_error_text(&e)))
    }

    /// Aborts the communicator (`ncclCommAbort`): kernels stuck waiting for peers exit,
    /// and every later call fails.
    pub fn abort(&mut self) {
        if let Some(c) = self.comm.take() {
            // cudarc's `Drop` for `Comm` aborts and panics if the abort fails.
            let _ = super::probe::guarded(move || drop(c));
        }
    }

    /// The device-side boundary of the backend: runs `prim` on device buffers, enqueued on
    /// the group's stream, and waits (polling, up to `deadline`) until it is done.
    ///
    /// `send` is read (`None` where the primitive reads nothing here: a broadcast's
    /// non-source, an `Exchange` that only receives); `recv` is written (`None` for sends).
    /// CUDA tensors will call this with their own storage, skipping [`Transport::run`]'s
    /// host copies.
    pub fn run_on_device<T: DeviceWire>(
        &self,
        op: &'static str,
        prim: &Prim,
        send: Option<&CudaSlice<T>>,
        recv: Option<&mut CudaSlice<T>>,
        deadline: Deadline,
    ) -> Result<()> {
        let comm = self.comm.as_ref().ok_or_else(|| {
            self.backend_err(op, "the communicator was aborted after an earlier failure".into())
        })?;
        let missing =
            |what: &str| self.backend_err(op, format!("internal error: no {what} buffer"));
        let nerr = self.nccl_err(op);
        match prim {
            Prim::AllReduce(rop) => {
                let (s, r) =
                    (send.ok_or_else(|| missing("send"))?, recv.ok_or_else(|| missing("receive"))?);
                comm.all_reduce(s, r, &nccl_op(*rop)).map_err(&nerr)?;
            }
            Prim::AllGather => {
                let (s, r) =
                    (send.ok_or_else(|| missing("send"))?, recv.ok_or_else(|| missing("receive"))?);
                comm.all_gather(s, r).map_err(&nerr)?;
            }
            Prim::ReduceScatter(rop) => {
                let (s, r) =
                    (send.ok_or_else(|| missing("send"))?, recv.ok_or_else(|| missing("receive"))?);
                comm.reduce_scatter(s, r, &nccl_op(*rop)).map_err(&nerr)?;
            }
            Prim::Broadcast { root } => {
                let r = recv.ok_or_else(|| missing("receive"))?;
                if *root == self.me && send.is_none() {
                    return Err(missing("broadcast source"));
                }
                comm.broadcast(send, r, *root as i32).map_err(&nerr)?;
            }
            Prim::Send { peer } => {
                comm.send(send.ok_or_else(|| missing("send"))?, *peer as i32).map_err(&nerr)?;
            }
            Prim::Recv { peer } => {
                comm.recv(recv.ok_or_else(|| missing("receive"))?, *peer as i32).map_err(&nerr)?;
            }
            Prim::Exchange { sends, recvs } => {
                self.exchange(comm, op, sends, recvs, send, recv)?;
            }
        }
        self.wait(op, prim, deadline)
    }

    /// Grouped sends and receives of `all_to_all`; pieces to itself are device copies.
    fn exchange<T: DeviceWire>(
        &self,
        comm: &Comm,
        op: &'static str,
        sends: &[(usize, usize, usize)],
        recvs: &[(usize, usize)],
        send: Option<&CudaSlice<T>>,
        mut recv: Option<&mut CudaSlice<T>>,
    ) -> Result<()> {
        let nerr = self.nccl_err(op);
        let oob = || self.backend_err(op, "internal error: piece out of bounds".into());
        let mut own_send = None;
        let mut own_recv = None;
        cudarc::nccl::group_start().map_err(&nerr)?;
        let mut issued: Result<()> = Ok(());
        for &(peer, start, len) in sends {
            if peer == self.me {
                own_send = Some((start, len));
                continue;
            }
            let Some(view) = send.and_then(|s| s.try_slice(start..start + len)) else {
                issued = Err(oob());
                break;
            };
            if let Err(e) = comm.send(&view, peer as i32) {
                issued = Err(nerr(e));
                break;
            }
        }
        let mut off = 0;
        for &(peer, len) in recvs {
            if issued.is_err() {
                break;
            }
            let at = off;
            off += len;
            if peer == self.me {
                own_recv = Some((at, len));
                continue;
            }
            let Some(mut view) = recv.as_deref_mut().and_then(|r| r.try_slice_mut(at..at + len))
            else {
                issued = Err(oob());
                break;
            };
            if let Err(e) = comm.recv(&mut view, peer as i32) {
                issued = Err(nerr(e));
            }
        }
        // Always close the group, even after a failed call inside it.
        let ended = cudarc::nccl::group_end().map_err(&nerr);
        issued?;
        ended?;
        if let (Some((s0, sl)), Some((r0, rl))) = (own_send, own_recv) {
            let src = send.and_then(|s| s.try_slice(s0..s0 + sl)).ok_or_else(oob)?;
            let mut dst = recv.and_then(|r| r.try_slice_mut(r0..r0 + rl)).ok_or_else(oob)?;
            if sl != rl {
                return Err(oob());
            }
            self.stream.memcpy_dtod(&src, &mut dst).map_err(self.driver_err(op))?;
        }
        Ok(())
    }

    /// Polls an event recorded after the enqueued work until it completes or `deadline`
    /// passes.
    fn wait(&self, op: &'static str, prim: &Prim, deadline: Deadline) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(self.driver_err(op))?;
        let start = Instant::now();
        loop {
            if ev.try_is_complete().map_err(self.driver_err(op))? {
                return Ok(());
            }
            if deadline.passed() {
                let waiting_for = match prim {
                    Prim::Send { peer } | Prim::Recv { peer } => {
                        vec![self.group.get(*peer).copied().unwrap_or(*peer)]
                    }
                    _ => Vec::new(),
                };
                return Err(CollectiveError::Timeout {
                    op,
                    group: self.group.to_vec(),
                    waiting_for,
                    after: deadline.timeout,
                    chain: Vec::new(),
                });
            }
            let waited = start.elapsed();
            if waited < Duration::from_micros(200) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(20) {
                std::thread::yield_now();
            } else if waited < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_micros(100));
            } else {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// [`Transport::run`] on elements `T` that are `U` (the same dtype): host → device,
    /// [`run_on_device`](NcclDevice::run_on_device), device → host.
    fn run_as<T: Wire, U: DeviceWire>(
        &mut self,
        op: &'static str,
        prim: &Prim,
        send: &[T],
        recv_len: usize,
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        let not_u = || {
            self.backend_err(
                op,
                format!("internal error: {} elements are not {}", T::DTYPE, U::DTYPE),
            )
        };
        let send: &[U] = bytemuck::try_cast_slice(send).map_err(|_| not_u())?;
        let derr = self.driver_err(op);
        let send_d =
            if send.is_empty() { None } else { Some(self.stream.clone_htod(send).map_err(&derr)?) };
        let mut recv_d = if recv_len == 0 {
            None
        } else {
            Some(self.stream.alloc_zeros::<U>(recv_len).map_err(&derr)?)
        };
        self.run_on_device(op, prim, send_d.as_ref(), recv_d.as_mut(), deadline)?;
        let back = match recv_d {
            None => Vec::new(),
            Some(r) => self.stream.clone_dtoh(&r).map_err(self.driver_err(op))?,
        };
        T::unwrap(U::wrap(back)).map_err(|_| not_u())
    }
}

impl Transport for NcclDevice {
    type DeviceJob = DeviceJob;

    fn size(&self) -> usize {
        self.group.len()
    }

    fn rank(&self) -> usize {
        self.me
    }

    fn group(&self) -> &[usize] {
        &self.group
    }

    /// The interim host path: host → device, [`run_on_device`](NcclDevice::run_on_device),
    /// device → host, on the NCCL datatype of `T`'s dtype.
    fn run<T: Wire>(
        &mut self,
        op: &'static str,
        prim: &Prim,
        send: &[T],
        recv_len: usize,
        deadline: Deadline,
    ) -> Result<Vec<T>> {
        match T::DTYPE {
            DType::F32 => self.run_as::<T, f32>(op, prim, send, recv_len, deadline),
            DType::F64 => self.run_as::<T, f64>(op, prim, send, recv_len, deadline),
            DType::BF16 => self.run_as::<T, half::bf16>(op, prim, send, recv_len, deadline),
            DType::F16 => self.run_as::<T, half::f16>(op, prim, send, recv_len, deadline),
            DType::I64 => self.run_as::<T, i64>(op, prim, send, recv_len, deadline),
        }
    }

    fn abort(&mut self) {
        NcclDevice::abort(self);
    }

    /// After the inputs' event, enqueues the NCCL call on the group's stream and records
    /// its completion event; nothing waits on the host.
    fn run_device(
        &mut self,
        seq: u64,
        job: DeviceJob,
        deadline: Deadline,
    ) -> Result<Arc<DeviceEvent>> {
        let op = job.op;
        let comm = self.comm.as_ref().ok_or_else(|| {
            self.backend_err(op, "the communicator was aborted after an earlier failure".into())
        })?;
        let derr = self.driver_err(op);
        self.stream.context().bind_to_thread().map_err(&derr)?;
        job.ready.wait_on(self.stream.cu_stream()).map_err(&derr)?;
        match job.dtype {
            DType::F32 => self.enqueue::<f32>(comm, &job)?,
            DType::F64 => self.enqueue::<f64>(comm, &job)?,
            DType::BF16 => self.enqueue::<half::bf16>(comm, &job)?,
            DType::F16 => self.enqueue::<half::f16>(comm, &job)?,
            DType::I64 => self.enqueue::<i64>(comm, &job)?,
        }
        let done = Arc::new(DeviceEvent::new().map_err(&derr)?);
        done.record(self.stream.cu_stream()).map_err(&derr)?;
        drop(derr);
        self.in_flight.push((done.clone(), seq, deadline, op));
        Ok(done)
    }

    fn device_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    fn poll_device(&mut self) -> Option<(CollectiveError, u64, Duration)> {
        let mut i = 0;
        while i < self.in_flight.len() {
            let (ev, seq, deadline, op) = &self.in_flight[i];
            match ev.is_complete() {
                Ok(true) => {
                    self.in_flight.swap_remove(i);
                }
                Ok(false) if deadline.passed() => {
                    let e = CollectiveError::Timeout {
                        op,
                        group: self.group.to_vec(),
                        waiting_for: Vec::new(),
                        after: deadline.timeout,
                        chain: Vec::new(),
                    };
                    let found = (e, *seq, deadline.timeout);
                    self.in_flight.clear();
                    return Some(found);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    let found = (self.driver_err(op)(e), *seq, deadline.timeout);
                    self.in_flight.clear();
                    return Some(found);
                }
            }
        }
        None
    }
}

impl Drop for NcclDevice {
    fn drop(&mut self) {
        self.abort();
    }
}

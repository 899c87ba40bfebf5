//! CUDA graph capture on a [`CudaDevice`]: the driver's stream capture of the handle's
//! stream (relaxed mode, so the allocations below may be made during it), with a
//! private memory pool: every allocation made during the capture is a plain
//! `cuMemAlloc` the graph owns, handed to no one else while the graph lives (a block
//! freed meanwhile waits in the pool), released when both the graph and the buffer
//! holding it are gone. Host round trips inside the capture fail in the driver (a
//! synchronizing copy invalidates the capture), and the capture then ends with that
//! error. Written to the driver's documented rules; the tests run the emulator's
//! capture, not this one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as dresult, sys, CudaContext, CudaStream};

use super::probe::driver_error;
use crate::cuda::graph::{GraphExec, GraphStats, CAPTURE_OP};
use crate::cuda::{cuda_error, DevPtr};
use crate::Result;

/// A graph's private pool: block -> (bytes, held by a buffer).
#[derive(Default)]
struct Pool {
    blocks: HashMap<DevPtr, (usize, bool)>,
    graph_alive: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Frees a pool's free blocks once its graph is gone.
fn release_free_blocks(ctx: &CudaContext, pool: &mut Pool) {
    if ctx.bind_to_thread().is_err() {
        return;
    }
    pool.blocks.retain(|&p, &mut (_, held)| {
        if !held {
            // SAFETY: a cuMemAlloc block of this context that neither the graph (gone)
            // nor a buffer (not held) uses any more.
            let _ = unsafe { dresult::free_sync(p) };
        }
        held
    });
}

/// A device handle's capture state and the pools of its graphs.
#[derive(Default)]
pub(super) struct GraphState {
    capturing: AtomicBool,
    capture: Mutex<Option<Arc<Mutex<Pool>>>>,
    pools: Mutex<Vec<Arc<Mutex<Pool>>>>,
    /// Blocks allocated before the capture and freed during it: freed when it ends
    /// (a free on the capturing stream would become a node of the graph).
    deferred: Mutex<Vec<DevPtr>>,
}

impl GraphState {
    pub(super) fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire)
    }

    /// Starts capturing `stream`.
    pub(super) fn begin(&self, op: &str, stream: &Arc<CudaStream>) -> Result<()> {
        let mut c = lock(&self.capture);
        if c.is_some() {
            return Err(cuda_error(CAPTURE_OP, format!("{op} is capturing already")));
        }
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| driver_error(op, "cuStreamBeginCapture", e))?;
        let pool = Arc::new(Mutex::new(Pool { blocks: HashMap::new(), graph_alive: true }));
        lock(&self.pools).push(pool.clone());
        *c = Some(pool);
        self.capturing.store(true, Ordering::Release);
        Ok(())
    }

    /// During a capture, `bytes` from the capture's pool (a freed block of that size, or
    /// a new `cuMemAlloc`); `None` outside one.
    pub(super) fn alloc(&self, op: &str, bytes: usize) -> Option<Result<DevPtr>> {
        if !self.is_capturing() {
            return None;
        }
        let pool = lock(&self.capture).clone()?;
        let mut pool = lock(&pool);
        if let Some((&p, e)) = pool.blocks.iter_mut().find(|(_, e)| e.0 == bytes && !e.1) {
            e.1 = true;
            return Some(Ok(p));
        }
        // SAFETY: a plain allocation in the current (bound) context.
        let r = unsafe { dresult::malloc_sync(bytes) }
            .map_err(|e| driver_error(op, &format!("allocating {bytes} bytes in capture"), e));
        if let Ok(p) = r {
            pool.blocks.insert(p, (bytes, true));
        }
        Some(r)
    }

    /// Whether `ptr` is a pool block (then it is marked free, and released if its graph
    /// is gone) or a block freed during a capture (freed when it ends): the caller must
    /// not free it itself.
    pub(super) fn free(&self, ctx: &CudaContext, ptr: DevPtr) -> bool {
        let pools = lock(&self.pools);
        for pool in pools.iter() {
            let mut pl = lock(pool);
            if let Some(e) = pl.blocks.get_mut(&ptr) {
                e.1 = false;
                if !pl.graph_alive {
                    release_free_blocks(ctx, &mut pl);
                }
                return true;
            }
        }
        if self.is_capturing() {
            lock(&self.deferred).push(ptr);
            return true;
        }
        false
    }

    /// Ends the capture of `stream`: its executable graph, or the driver's error.
    pub(super) fn end(
        &self,
        op: &str,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
    ) -> Result<Box<dyn GraphExec>> {
        let pool = lock(&self.capture).take();
        self.capturing.store(false, Ordering::Release);
        let Some(pool) = pool else {
            return Err(cuda_error(CAPTURE_OP, format!("{op} is not capturing")));
        };
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        for p in lock(&self.deferred).drain(..) {
            // SAFETY: a block of this context its buffer gave up during the capture; the
            // stream-ordered free runs after the work queued before it.
            let _ = unsafe {
                if ctx.has_async_alloc() {
                    dresult::free_async(p, stream.cu_stream())
                } else {
                    let _ = stream.synchronize();
                    dresult::free_sync(p)
                }
            };
        }
        let graph = match graph {
            Ok(Some(g)) => g,
            Ok(None) => {
                let mut pl = lock(&pool);
                pl.graph_alive = false;
                release_free_blocks(ctx, &mut pl);
                return Err(cuda_error(CAPTURE_OP, format!("{op}: the capture recorded nothing")));
            }
            Err(e) => {
                let mut pl = lock(&pool);
                pl.graph_alive = false;
                release_free_blocks(ctx, &mut pl);
                return Err(driver_error(op, "the capture failed (cuStreamEndCapture)", e));
            }
        };
        Ok(Box::new(GpuGraph { graph: Mutex::new(SendGraph(graph)), pool, ctx: ctx.clone() }))
    }
}

/// cudarc's graph, moved between threads under [`GpuGraph`]'s mutex.
struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: the driver requires calls on one graph to be serialized, not to come from
// one thread; every use goes through `GpuGraph::graph`'s mutex.
unsafe impl Send for SendGraph {}

/// An executable graph of a [`super::CudaDevice`] and its private pool.
struct GpuGraph {
    graph: Mutex<SendGraph>,
    pool: Arc<Mutex<Pool>>,
    ctx: Arc<CudaContext>,
}

impl GraphExec for GpuGraph {
    fn replay(&self) -> Result<()> {
        lock(&self.graph).0.launch().map_err(|e| driver_error(CAPTURE_OP, "cuGraphLaunch", e))
    }

    fn stats(&self) -> GraphStats {
        let pool = lock(&self.pool);
        GraphStats {
            kernels: 0,
            copies: 0,
            pool_blocks: pool.blocks.len(),
            pool_bytes: pool.blocks.values().map(|&(b, _)| b).sum(),
        }
    }
}

impl Drop for GpuGraph {
    fn drop(&mut self) {
        // The graph's work must be done before its blocks go back to the driver.
        let _ = self.ctx.synchronize();
        let mut pool = lock(&self.pool);
        pool.graph_alive = false;
        release_free_blocks(&self.ctx, &mut pool);
    }
}

//! Deferred index checks on the emulated CUDA device: with deferral on, the
//! embedding and cross-entropy forwards read no status back and return `Ok` for a
//! bad id, and `check_deferred_index_checks` returns exactly the error the
//! immediate check gives (computed by the same op with deferral off). Each test
//! uses its own device ordinal so the device's work counts are its own.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_kernels::KernelError;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor, TensorError};

fn setup(ordinal: usize) -> Device {
    gpu::register_device(ordinal, EmulatedGpu::open(ordinal).expect("emulator"));
    Device::Cuda(ordinal)
}

fn dtoh_reads(ordinal: usize) -> u64 {
    gpu::work_counts(ordinal).expect("the emulator counts its work").dtoh_reads
}

fn ids(dev: Device, v: Vec<i64>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, [n]).unwrap().to_device(dev).unwrap()
}

/// `f` with deferral on this thread: the op must return `Ok` without reading
/// anything back and leave one check pending, which then gives `f`'s immediate
/// result (run with deferral off) as its error, or `Ok` for good ids.
fn compare(ordinal: usize, what: &str, f: impl Fn() -> Result<Tensor, TensorError>) {
    assert!(!gpu::index_checks_deferred(), "{what}: off by default");
    let immediate = f().map(|t| t.to_vec_f64().unwrap());

    assert!(!gpu::defer_index_checks(true));
    let before = dtoh_reads(ordinal);
    let deferred = f();
    let reads = dtoh_reads(ordinal) - before;
    assert!(deferred.is_ok(), "{what}: the op itself returns Ok: {deferred:?}");
    assert_eq!(reads, 0, "{what}: a deferred op reads nothing back");
    assert_eq!(gpu::pending_index_checks(), 1, "{what}");
    let checked = gpu::check_deferred_index_checks();
    assert_eq!(gpu::pending_index_checks(), 0, "{what}: the check clears the list");
    assert!(gpu::defer_index_checks(false));
    match (&immediate, &checked) {
        (Err(want), Err(got)) => {
            assert_eq!(got.to_string(), want.to_string(), "{what}");
            let (
                TensorError::Kernel(KernelError::IndexOutOfRange {
                    op: a,
                    index: i,
                    position: p,
                    size: s,
                }),
                TensorError::Kernel(KernelError::IndexOutOfRange {
                    op: b,
                    index: j,
                    position: q,
                    size: t,
                }),
            ) = (got, want)
            else {
                panic!("{what}: expected IndexOutOfRange from both, got {got:?} and {want:?}")
            };
            assert_eq!((a, i, p, s), (b, j, q, t), "{what}");
        }
        (Ok(want), Ok(())) => {
            // Good ids: the deferred op computed the same values.
            let got = deferred.unwrap().to_vec_f64().unwrap();
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(want), "{what}: values");
        }
        _ => panic!("{what}: immediate {immediate:?} but deferred check {checked:?}"),
    }
}

#[test]
fn deferred_embedding_reports_the_immediate_error() {
    let dev = setup(11);
    let mut rng = Rng::new(5);
    let w = Tensor::randn([10, 4], DType::F32, &mut rng).unwrap().to_device(dev).unwrap();
    let bad = ids(dev, vec![3, 0, 12, 9, -2]);
    compare(11, "embedding, bad id", || Tensor::embedding(&bad, &w));
    let good = ids(dev, vec![3, 0, 9, 9]);
    compare(11, "embedding, good ids", || Tensor::embedding(&good, &w));
    // The immediate default: the op itself fails, nothing is pending.
    let err = Tensor::embedding(&bad, &w).unwrap_err();
    assert!(err.to_string().contains("index 12 at position 2"), "{err}");
    assert_eq!(gpu::pending_index_checks(), 0);
}

#[test]
fn deferred_cross_entropy_reports_the_immediate_error() {
    let dev = setup(12);
    let mut rng = Rng::new(6);
    let logits = Tensor::randn([5, 7], DType::F32, &mut rng).unwrap().to_device(dev).unwrap();
    let bad = ids(dev, vec![1, -100, 6, 7, 0]);
    compare(12, "cross_entropy, bad target", || logits.cross_entropy(&bad, -100));
    let good = ids(dev, vec![1, -100, 6, 2, 0]);
    compare(12, "cross_entropy, good targets", || logits.cross_entropy(&good, -100));
    // The vocab-parallel step: targets of the shard starting at 0 with 7 classes.
    let sum = |r: (Tensor, Tensor, Tensor)| Tensor::cat(&[r.0, r.1, r.2], 0);
    compare(12, "ce_shard_stats, bad target", || {
        logits.ce_shard_stats(&bad, 0, 7, -100).and_then(sum)
    });
    compare(12, "ce_shard_stats, good targets", || {
        logits.ce_shard_stats(&good, 0, 7, -100).and_then(sum)
    });
    let err = logits.cross_entropy(&bad, -100).unwrap_err();
    assert!(err.to_string().contains("index 7 at position 3"), "{err}");
    assert_eq!(gpu::pending_index_checks(), 0);
}

/// Several pending checks are read with one device-to-host read, and the first bad
/// call in launch order gives the error.
#[test]
fn several_pending_checks_are_read_at_once() {
    let dev = setup(13);
    let mut rng = Rng::new(7);
    let w = Tensor::randn([10, 4], DType::F32, &mut rng).unwrap().to_device(dev).unwrap();
    let logits = Tensor::randn([4, 10], DType::F32, &mut rng).unwrap().to_device(dev).unwrap();
    let good = ids(dev, vec![1, 2, 3, 4]);
    let bad_ids = ids(dev, vec![1, 2, 30, 4]);
    let bad_targets = ids(dev, vec![1, 11, 3, 4]);

    gpu::defer_index_checks(true);
    let before = dtoh_reads(13);
    Tensor::embedding(&good, &w).unwrap();
    logits.cross_entropy(&good, -100).unwrap();
    Tensor::embedding(&good, &w).unwrap();
    assert_eq!(gpu::pending_index_checks(), 3);
    gpu::check_deferred_index_checks().unwrap();
    assert_eq!(dtoh_reads(13) - before, 1, "three good checks: one read");
    assert_eq!(gpu::pending_index_checks(), 0);
    gpu::check_deferred_index_checks().unwrap();
    assert_eq!(dtoh_reads(13) - before, 1, "nothing pending: no read");

    Tensor::embedding(&good, &w).unwrap();
    logits.cross_entropy(&bad_targets, -100).unwrap();
    Tensor::embedding(&bad_ids, &w).unwrap();
    let got = gpu::check_deferred_index_checks().unwrap_err();
    assert_eq!(gpu::pending_index_checks(), 0);
    gpu::defer_index_checks(false);
    let want = logits.cross_entropy(&bad_targets, -100).unwrap_err();
    assert_eq!(got.to_string(), want.to_string(), "the first bad call's error");
}

/// Deferral is per thread: another thread still checks at once.
#[test]
fn deferral_is_per_thread() {
    let dev = setup(14);
    let mut rng = Rng::new(8);
    let w = Tensor::randn([10, 4], DType::F32, &mut rng).unwrap().to_device(dev).unwrap();
    let bad = ids(dev, vec![3, 10]);
    gpu::defer_index_checks(true);
    let other = std::thread::scope(|s| {
        s.spawn(|| (gpu::index_checks_deferred(), Tensor::embedding(&bad, &w).is_err())).join()
    })
    .unwrap();
    assert_eq!(other, (false, true));
    assert!(Tensor::embedding(&bad, &w).is_ok());
    assert!(gpu::check_deferred_index_checks().is_err());
    gpu::defer_index_checks(false);
}

/// The explicit range check (a vocab-sharded lookup's global check) defers too, and its
/// deferred error is the immediate one; on the host it checks at once.
#[test]
fn deferred_range_check_reports_the_immediate_error() {
    let dev = setup(15);
    let host = Tensor::from_vec(vec![3i64, 0, 10, -1], [4]).unwrap();
    let want = host.check_index_range(10, "embedding").unwrap_err();
    assert!(want.to_string().contains("index 10 at position 2"), "{want}");
    let bad = host.to_device(dev).unwrap();
    let immediate = bad.check_index_range(10, "embedding").unwrap_err();
    assert_eq!(immediate.to_string(), want.to_string());

    gpu::defer_index_checks(true);
    let before = dtoh_reads(15);
    bad.check_index_range(10, "embedding").unwrap();
    assert_eq!(dtoh_reads(15) - before, 0, "a deferred check reads nothing back");
    assert_eq!(gpu::pending_index_checks(), 1);
    let got = gpu::check_deferred_index_checks().unwrap_err();
    assert_eq!(got.to_string(), want.to_string());
    ids(dev, vec![0, 9]).check_index_range(10, "embedding").unwrap();
    gpu::check_deferred_index_checks().unwrap();
    assert_eq!(gpu::pending_index_checks(), 0);
    // Still an error at once on the host.
    assert!(host.check_index_range(10, "embedding").is_err());
    gpu::defer_index_checks(false);
}

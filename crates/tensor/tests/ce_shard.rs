//! The local steps of the vocab-parallel cross-entropy (`Tensor::ce_shard_stats`,
//! `ce_rescale`, `ce_lse`, `ce_loss_sums`, `ce_shard_backward`) on the host: composed
//! over uneven vocab shards they give the loss and gradient of an f64 reference
//! written here; over one shard they are bit-identical to the plain
//! `Tensor::cross_entropy`; f64 logits on the emulated CUDA device equal the host bit
//! for bit; bad input is a typed error.

use tpar_kernels::cuda::emu::EmulatedGpu;
use tpar_tensor::tol::Tol;
use tpar_tensor::{gpu, DType, Device, Rng, Tensor, TensorError};

const IGNORE: i64 = -100;

/// Loss and gradient of cross-entropy (mean over non-ignored rows) in f64, from
/// `logits` `[rows, vocab]` read as f64.
fn reference(logits: &[f64], vocab: usize, targets: &[i64]) -> (f64, Vec<f64>) {
    let count = targets.iter().filter(|&&t| t != IGNORE).count() as f64;
    let (mut total, mut grad) = (0.0, vec![0.0; logits.len()]);
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE {
            continue;
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        total += lse - row[t as usize];
        for c in 0..vocab {
            let onehot = if c == t as usize { 1.0 } else { 0.0 };
            grad[r * vocab + c] = ((row[c] - lse).exp() - onehot) / count;
        }
    }
    (total / count, grad)
}

/// The steps composed over the vocab shards `shards` (columns `starts[k]..`), with the
/// all_reduces written as tensor ops: (loss, gradient in the logits' dtype).
fn sharded(shards: &[Tensor], starts: &[i64], vocab: usize, targets: &Tensor) -> (Tensor, Tensor) {
    let stats: Vec<_> = shards
        .iter()
        .zip(starts)
        .map(|(s, &v0)| s.ce_shard_stats(targets, v0, vocab, IGNORE).unwrap())
        .collect();
    let gmax = stats.iter().skip(1).fold(stats[0].0.clone(), |m, s| m.maximum(&s.0).unwrap());
    let sumexp = stats
        .iter()
        .map(|(m, s, _)| Tensor::ce_rescale(m, s, &gmax).unwrap())
        .reduce(|a, b| a.add(&b).unwrap())
        .unwrap();
    let tl = stats.iter().map(|s| s.2.clone()).reduce(|a, b| a.add(&b).unwrap()).unwrap();
    let lse = Tensor::ce_lse(&gmax, &sumexp).unwrap();
    let sums = Tensor::ce_loss_sums(&lse, &tl, targets, IGNORE).unwrap();
    let count = sums.narrow(0, 1, 1).unwrap();
    let loss = sums.narrow(0, 0, 1).unwrap().div(&count).unwrap();
    let scale = count.recip().unwrap().to_dtype(lse.dtype()).unwrap();
    let grads: Vec<Tensor> = shards
        .iter()
        .zip(starts)
        .map(|(s, &v0)| s.ce_shard_backward(targets, v0, IGNORE, &lse, &scale).unwrap())
        .collect();
    (loss.reshape(Vec::<usize>::new()).unwrap(), Tensor::cat(&grads, 1).unwrap())
}

fn inputs(dtype: DType, rows: usize, vocab: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    let logits = Tensor::randn([rows, vocab], dtype, &mut rng).unwrap().mul_scalar(3.0).unwrap();
    let targets: Vec<i64> =
        (0..rows).map(|r| if r % 3 == 1 { IGNORE } else { ((r * 5 + 2) % vocab) as i64 }).collect();
    (logits, Tensor::from_vec(targets, [rows]).unwrap())
}

#[test]
fn host_steps_over_uneven_vocab_shards_match_an_f64_reference() {
    // vocab 11 over 3 shards, as torch.chunk cuts it: 4, 4, 3 columns.
    let (rows, vocab) = (7usize, 11usize);
    for (i, dtype) in [DType::F64, DType::F32, DType::BF16, DType::F16].into_iter().enumerate() {
        let (logits, targets) = inputs(dtype, rows, vocab, 11 + i as u64);
        let shards: Vec<Tensor> = [(0, 4), (4, 4), (8, 3)]
            .iter()
            .map(|&(s, n)| logits.narrow(1, s, n).unwrap())
            .collect();
        let (loss, grad) = sharded(&shards, &[0, 4, 8], vocab, &targets);
        let stats = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        assert_eq!(grad.dtype(), dtype);
        assert_eq!(loss.dtype(), DType::F64, "host loss sums are f64");
        let (want_loss, want_grad) =
            reference(&logits.to_vec_f64().unwrap(), vocab, &targets.to_vec::<i64>().unwrap());
        // The statistics are in the accumulator type; the gradient is rounded to `dtype`.
        let tol = Tol::for_dtype(stats).scaled(10.0);
        tol.check(&format!("{dtype} loss"), &[loss.item().unwrap()], &[want_loss]).unwrap();
        Tol::for_dtype(dtype)
            .scaled(2.0)
            .check(&format!("{dtype} gradient"), &grad.to_vec_f64().unwrap(), &want_grad)
            .unwrap();
    }
}

#[test]
fn one_shard_is_bit_identical_to_the_plain_op() {
    let (rows, vocab) = (6usize, 9usize);
    for (i, dtype) in [DType::F64, DType::F32, DType::BF16].into_iter().enumerate() {
        let (logits, targets) = inputs(dtype, rows, vocab, 30 + i as u64);
        let leaf = logits.detach().requires_grad_(true);
        let plain = leaf.cross_entropy(&targets, IGNORE).unwrap();
        plain.backward().unwrap();
        let (loss, grad) = sharded(&[logits.detach()], &[0], vocab, &targets);
        let loss = loss.to_dtype(dtype).unwrap();
        assert_eq!(loss.to_vec_f64().unwrap(), plain.to_vec_f64().unwrap(), "{dtype} loss");
        assert_eq!(
            grad.to_vec_f64().unwrap(),
            leaf.grad().unwrap().to_vec_f64().unwrap(),
            "{dtype} grad"
        );
    }
}

#[test]
fn f64_logits_on_the_emulated_device_equal_the_host_bit_for_bit() {
    gpu::register_device(0, EmulatedGpu::open(0).expect("emulator"));
    let dev = Device::Cuda(0);
    let (rows, vocab) = (5usize, 8usize);
    let (logits, targets) = inputs(DType::F64, rows, vocab, 7);
    let host_shards = [logits.narrow(1, 0, 5).unwrap(), logits.narrow(1, 5, 3).unwrap()];
    let dev_shards: Vec<Tensor> = host_shards.iter().map(|s| s.to_device(dev).unwrap()).collect();
    let (want_loss, want_grad) = sharded(&host_shards, &[0, 5], vocab, &targets);
    let (loss, grad) = sharded(&dev_shards, &[0, 5], vocab, &targets.to_device(dev).unwrap());
    assert_eq!((loss.device(), grad.device()), (dev, dev));
    assert_eq!(loss.to_vec_f64().unwrap(), want_loss.to_vec_f64().unwrap());
    assert_eq!(grad.to_vec_f64().unwrap(), want_grad.to_vec_f64().unwrap());
}

#[test]
fn bad_input_is_a_typed_error() {
    let (logits, _) = inputs(DType::F32, 6, 14, 3);
    let shard = logits.narrow(1, 0, 7).unwrap();
    // A target outside the vocab, named as the plain op names it.
    let bad = Tensor::from_vec(vec![1i64, 2, 14, 0, 0, 0], [6]).unwrap();
    let err = shard.ce_shard_stats(&bad, 0, 14, IGNORE).unwrap_err();
    assert!(err.to_string().contains("index 14 at position 2"), "{err}");
    // Targets that are not one i64 per row.
    let short = Tensor::from_vec(vec![1i64, 2], [2]).unwrap();
    let err = shard.ce_shard_stats(&short, 0, 14, IGNORE).unwrap_err();
    assert!(matches!(err, TensorError::InvalidArgument { op: "ce_shard_stats", .. }), "{err}");
    // A shard that does not fit in the vocab.
    let ok = Tensor::from_vec(vec![1i64; 6], [6]).unwrap();
    assert!(shard.ce_shard_stats(&ok, 10, 14, IGNORE).is_err());
    // Integer logits.
    let ints = Tensor::from_vec(vec![0i64; 12], [6, 2]).unwrap();
    let err = ints.ce_shard_stats(&ok, 0, 2, IGNORE).unwrap_err();
    assert!(matches!(err, TensorError::DTypeMismatch { .. }), "{err}");
    // Statistics of two dtypes, or of different lengths.
    let (m, s, _) = shard.ce_shard_stats(&ok, 0, 14, IGNORE).unwrap();
    let err = Tensor::ce_lse(&m, &s.to_dtype(DType::F64).unwrap()).unwrap_err();
    assert!(matches!(err, TensorError::InvalidArgument { op: "ce_lse", .. }), "{err}");
    let err = Tensor::ce_rescale(&m, &s, &m.narrow(0, 0, 3).unwrap()).unwrap_err();
    assert!(matches!(err, TensorError::InvalidArgument { op: "ce_rescale", .. }), "{err}");
    // An lse in the wrong dtype for the logits, a scale of two values.
    let lse = Tensor::ce_lse(&m, &s).unwrap();
    let scale = Tensor::from_f64(&[0.5], [1], DType::F32).unwrap();
    let err = shard
        .ce_shard_backward(&ok, 0, IGNORE, &lse.to_dtype(DType::F64).unwrap(), &scale)
        .unwrap_err();
    assert!(matches!(err, TensorError::InvalidArgument { op: "ce_shard_backward", .. }), "{err}");
    let two = Tensor::from_f64(&[0.5, 0.5], [2], DType::F32).unwrap();
    assert!(shard.ce_shard_backward(&ok, 0, IGNORE, &lse, &two).is_err());
    // Loss sums need one i64 target per row.
    let err = Tensor::ce_loss_sums(&lse, &lse, &short, IGNORE).unwrap_err();
    assert!(matches!(err, TensorError::InvalidArgument { op: "ce_loss_sums", .. }), "{err}");
}

#[test]
fn meta_logits_give_meta_statistics() {
    let logits = Tensor::empty([4, 6], DType::BF16, Device::Meta).unwrap();
    let targets = Tensor::empty([4], DType::I64, Device::Meta).unwrap();
    let (m, s, t) = logits.ce_shard_stats(&targets, 0, 6, IGNORE).unwrap();
    for x in [&m, &s, &t] {
        assert_eq!((x.device(), x.dtype(), x.dims()), (Device::Meta, DType::F32, &[4usize][..]));
    }
    let lse = Tensor::ce_lse(&m, &s).unwrap();
    let sums = Tensor::ce_loss_sums(&lse, &t, &targets, IGNORE).unwrap();
    assert_eq!((sums.device(), sums.dims()), (Device::Meta, &[2usize][..]));
}

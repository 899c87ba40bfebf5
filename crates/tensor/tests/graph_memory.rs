//! The autograd graph keeps alive only what backward closures saved: an intermediate
//! that no backward needs is freed when its last user lets go of it, as in PyTorch,
//! whose graph holds edges, not tensors, and whose ops save only what their backward
//! reads.

#[global_allocator]
static ALLOC: tpar_tensor::memory::TrackingAllocator = tpar_tensor::memory::TrackingAllocator;

use tpar_tensor::{autograd, memory, DType, Device, Tensor, TensorError};

const N: usize = 1 << 20; // 4 MiB of f32

/// Bytes this thread's rank holds after `f` returns, less what it held before.
fn held_after(
    rank: usize,
    f: impl FnOnce() -> Result<Vec<Tensor>, TensorError>,
) -> (i64, Vec<Tensor>) {
    memory::cache::set_limit(0);
    memory::set_rank(Some(rank));
    let base = memory::current(rank);
    let kept = f().unwrap();
    (memory::current(rank) - base, kept)
}

#[test]
fn intermediates_no_backward_saved_are_freed() {
    std::thread::spawn(|| {
        let x = Tensor::ones([N], DType::F32, Device::Cpu).unwrap().requires_grad_(true);
        // a = 2x and b = 3a save nothing of their inputs (a scale's backward needs only
        // the scale): once `a` is dropped only `b` is held.
        let (held, kept) = held_after(40, || {
            let a = x.mul_scalar(2.0)?;
            let b = a.mul_scalar(3.0)?;
            Ok(vec![b])
        });
        let four_mib = (N * 4) as i64;
        assert!(held >= four_mib, "b itself is held: {held}");
        assert!(
            held < four_mib + four_mib / 2,
            "the graph held a dropped intermediate: {held} bytes"
        );
        // The graph still reaches x: its gradient is 6 everywhere.
        kept[0].sum_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap().to_vec::<f32>().unwrap();
        assert!(g.iter().all(|&v| v == 6.0));
        // A sum saves neither operand (its backward passes the gradient through).
        let (held, kept) = held_after(42, || {
            let a = x.mul_scalar(2.0)?;
            let b = x.mul_scalar(3.0)?;
            Ok(vec![a.add(&b)?])
        });
        assert!(held < four_mib + four_mib / 2, "a sum kept its operands: {held} bytes");
        x.zero_grad();
        kept[0].sum_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap().to_vec::<f32>().unwrap();
        assert!(g.iter().all(|&v| v == 5.0));
        // What a backward does need stays: y = a * a saves `a`.
        let (held, kept) = held_after(41, || {
            let a = x.mul_scalar(2.0)?;
            let y = a.mul(&a)?;
            Ok(vec![y])
        });
        assert!(held >= 2 * four_mib, "a (saved by the product) and y: {held}");
        x.zero_grad();
        kept[0].sum_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap().to_vec::<f32>().unwrap();
        assert!(g.iter().all(|&v| v == 8.0), "d(4x^2)/dx at 1 is 8");
    })
    .join()
    .unwrap();
}

/// A backward pass frees what each node saved once it has run the node (PyTorch's
/// default): a chain of products that each save a 4 MiB intermediate holds them all after
/// the forward, and none once the backward has passed, while the loss is still held; the
/// pass's peak stays below the forward's activations plus the gradients it makes. A
/// second backward through the freed graph is an error naming the node;
/// `backward_retain_graph` keeps everything for one.
/// The sum of `x` squared `links` times: y_{k+1} = y_k * y_k saves y_k (as large as `x`
/// each), and only the graph holds them.
fn squares(x: &Tensor, links: usize) -> Result<Vec<Tensor>, TensorError> {
    let mut y = x.mul_scalar(1.0)?;
    for _ in 0..links {
        y = y.mul(&y)?;
    }
    Ok(vec![y.sum_all()?])
}

#[test]
fn backward_frees_saved_tensors_as_it_goes() {
    std::thread::spawn(|| {
        const LINKS: usize = 6;
        let four_mib = (N * 4) as i64;
        let x = Tensor::full([N], 0.5, DType::F32, Device::Cpu).unwrap().requires_grad_(true);
        let chain = || squares(&x, LINKS);
        let (held, kept) = held_after(43, chain);
        assert!(held >= LINKS as i64 * four_mib, "the forward keeps every link: {held}");
        let loss = kept.into_iter().next().unwrap();
        let before = memory::current(43);
        memory::reset_peak(43);
        loss.backward().unwrap();
        let after = memory::current(43) - before;
        let peak = memory::peak(43) - before;
        // Only x's gradient was added; the links' saved tensors are gone.
        assert!(
            after < -(LINKS as i64 - 1) * four_mib,
            "the pass freed {} bytes of {} saved",
            -after,
            LINKS as i64 * four_mib
        );
        // A link's backward holds the incoming gradient, both operands' and their sum.
        assert!(
            peak <= 4 * four_mib + (64 << 10),
            "the pass rose {peak} bytes above the forward's end"
        );
        let err = loss.backward().unwrap_err().to_string();
        assert!(err.contains("through sum a second time"), "{err}");

        // Retained: the saved tensors stay, and a second pass gives the same gradient
        // again (added into .grad()).
        x.zero_grad();
        let (_, kept) = held_after(44, chain);
        let loss = kept.into_iter().next().unwrap();
        let before = memory::current(44);
        loss.backward_retain_graph(None).unwrap();
        let first = x.grad().unwrap().to_vec::<f32>().unwrap();
        assert!(memory::current(44) - before > 0, "a retained graph keeps what it saved");
        loss.backward().unwrap();
        let twice = x.grad().unwrap().to_vec::<f32>().unwrap();
        assert!(first.iter().zip(&twice).all(|(a, b)| *b == 2.0 * *a));
    })
    .join()
    .unwrap();
}

/// `autograd::grad` frees the graph as `torch.autograd.grad` does by default, and
/// `grad_retain_graph` keeps it.
#[test]
fn autograd_grad_frees_the_graph_unless_retained() {
    std::thread::spawn(|| {
        const LINKS: usize = 4;
        let four_mib = (N * 4) as i64;
        let x = Tensor::full([N], 0.5, DType::F32, Device::Cpu).unwrap().requires_grad_(true);
        let chain = || squares(&x, LINKS);
        let one = Tensor::full([], 1.0, DType::F32, Device::Cpu).unwrap();
        let ins = [x.clone()];

        let (_, kept) = held_after(45, chain);
        let loss = kept.into_iter().next().unwrap();
        let before = memory::current(45);
        let (outs, seeds) = (std::slice::from_ref(&loss), std::slice::from_ref(&one));
        let kept_grad = autograd::grad_retain_graph(outs, seeds, &ins).unwrap().remove(0).unwrap();
        let retained = memory::current(45) - before;
        // The gradient returned (4 MiB) and every link's saved operands: freed, they would
        // take 4 MiB each off. Within 64 KiB, as the peak above: small blocks this thread
        // allocated before the measurement (work handed to the rayon workers, which tests
        // beside this one keep busy) can be freed while it measures (one loaded run
        // measured 1208 bytes under).
        assert!(
            retained >= four_mib - (64 << 10),
            "a retained graph keeps what it saved: {retained}"
        );
        let again = autograd::grad(outs, seeds, &ins).unwrap().remove(0).unwrap();
        assert_eq!(kept_grad.to_vec::<f32>().unwrap(), again.to_vec::<f32>().unwrap());
        assert!(x.grad().is_none(), "grad returns gradients, it does not accumulate them");
        drop((kept_grad, again));
        // The second pass freed the links: only the loss's own node is left.
        let after = memory::current(45) - before;
        assert!(
            after < -(LINKS as i64 - 1) * four_mib,
            "grad freed {} bytes of {} saved",
            -after,
            LINKS as i64 * four_mib
        );
        let err = autograd::grad(outs, seeds, &ins).unwrap_err().to_string();
        assert!(err.contains("a second time"), "{err}");
    })
    .join()
    .unwrap();
}

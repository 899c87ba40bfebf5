//! Gradients held in full (`ReplicatedGrad`) in the engine, on one thread playing one
//! rank of a group: a tag passes only through nodes replicated over its group (or
//! replication-aware ones), and anywhere else it is demoted (the value on the root, zeros
//! on other ranks), so untagged gradients keep the contribution convention.

use std::sync::{Arc, Mutex};

use tpar_tensor::autograd::{
    incoming_grad_replicated, record_replication_aware, set_input_grad_replicated, ReplicatedGrad,
};
use tpar_tensor::{Result, Tensor};

const GROUP: u64 = 7;

fn leaf(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), [v.len()]).unwrap().requires_grad_(true)
}

/// An identity that says its output is replicated over [`GROUP`] and records the tag of
/// the gradient it gets; with `tag_input`, it tags its input's gradient as `tag_input`.
fn source(
    x: &Tensor,
    seen: Arc<Mutex<Vec<Option<ReplicatedGrad>>>>,
    tag_input: Option<ReplicatedGrad>,
) -> Tensor {
    record_replication_aware("source", &[x], x.detach(), Some(GROUP), move |g| {
        seen.lock().unwrap().push(incoming_grad_replicated());
        if let Some(t) = tag_input {
            set_input_grad_replicated(0, t);
        }
        Ok(vec![Some(g.clone())])
    })
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[test]
fn a_tag_passes_through_replicated_nodes_and_is_demoted_elsewhere() -> Result<()> {
    for root in [true, false] {
        let tag = ReplicatedGrad { group: GROUP, root };
        // Through replicated nodes only (mul_scalar, square, sum of one replicated value):
        // the aware source sees the tag and the full gradient.
        let x = leaf(&[1.0, 2.0]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = source(&x, seen.clone(), Some(tag));
        assert_eq!(s.replicated_group(), Some(GROUP));
        let y = s.square()?.mul_scalar(3.0)?.sum_all()?;
        assert_eq!(y.replicated_group(), Some(GROUP));
        y.backward_with_replicated(&Tensor::from_vec(vec![1.0f64], Vec::<usize>::new())?, tag)?;
        assert_eq!(*seen.lock().unwrap(), vec![Some(tag)]);
        // The source hands the full gradient on, tagged; the leaf's is demoted: full on
        // the root, zeros elsewhere.
        let want = if root { vec![6.0, 12.0] } else { vec![0.0, 0.0] };
        assert_eq!(vals(&x.grad().unwrap()), want, "root {root}");

        // A node with an input that is not replicated (a leaf) demotes the tag before
        // its closure runs: the source sees an untagged contribution.
        let x = leaf(&[1.0, 2.0]);
        let w = leaf(&[0.5, -1.0]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = source(&x, seen.clone(), None);
        let y = s.mul(&w)?.sum_all()?;
        assert_eq!(y.replicated_group(), None);
        y.backward_with_replicated(&Tensor::from_vec(vec![1.0f64], Vec::<usize>::new())?, tag)?;
        assert_eq!(*seen.lock().unwrap(), vec![None]);
        let want = if root { vec![0.5, -1.0] } else { vec![0.0, 0.0] };
        assert_eq!(vals(&x.grad().unwrap()), want, "root {root}");

        // A tagged gradient summed with an untagged one: the tagged one is demoted first.
        let x = leaf(&[1.0, 2.0]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = source(&x, seen.clone(), None);
        let a = source(&s, Arc::new(Mutex::new(Vec::new())), Some(tag)); // tags s's gradient
        let b = s.mul_scalar(2.0)?; // untagged contribution to s's gradient
        let y = a.add(&b)?.sum_all()?;
        y.backward_with(&Tensor::from_vec(vec![1.0f64], Vec::<usize>::new())?)?;
        assert_eq!(*seen.lock().unwrap(), vec![None]);
        let want = if root { vec![3.0, 3.0] } else { vec![2.0, 2.0] };
        assert_eq!(vals(&x.grad().unwrap()), want, "root {root}");
    }
    Ok(())
}

//! A leaf's own gradient state: whether its gradient is already reduced, and whether the
//! leaf was replaced in its module. Both live on the tensor, so every handle of the leaf
//! sees them and no other tensor does.

use tpar_tensor::Tensor;

fn leaf(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), [v.len()]).unwrap().requires_grad_(true)
}

#[test]
fn a_reduced_gradient_stays_reduced_until_the_next_accumulation_or_clear() {
    let a = leaf(&[1.0, 2.0]);
    a.sum_all().unwrap().backward().unwrap();
    assert!(a.grad().is_some());
    assert!(a.reduced_grad().is_none(), "a backward's gradient is not reduced");
    a.set_reduced_grad(Some(Tensor::from_vec(vec![5.0f32, 5.0], [2]).unwrap()));
    assert_eq!(a.reduced_grad().unwrap().to_vec::<f32>().unwrap(), [5.0, 5.0]);
    // Every handle of the leaf sees it (an optimizer's copy of the parameter).
    let copy = a.clone();
    assert!(copy.reduced_grad().is_some());
    // Another leaf's mark is its own.
    let b = leaf(&[3.0, 4.0]);
    b.set_reduced_grad(Some(Tensor::from_vec(vec![1.0f32, 1.0], [2]).unwrap()));
    assert_eq!(a.reduced_grad().unwrap().to_vec::<f32>().unwrap(), [5.0, 5.0]);
    // A backward that accumulates into the leaf makes the sum unreduced.
    a.sum_all().unwrap().backward().unwrap();
    assert!(a.reduced_grad().is_none());
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), [6.0, 6.0]);
    // set_grad and zero_grad clear the mark too.
    a.set_reduced_grad(a.grad());
    a.set_grad(a.grad());
    assert!(a.reduced_grad().is_none() && a.grad().is_some());
    a.set_reduced_grad(a.grad());
    a.zero_grad();
    assert!(a.reduced_grad().is_none() && a.grad().is_none());
    assert!(b.reduced_grad().is_some());
}

#[test]
fn a_retired_leaf_is_seen_as_retired_by_every_handle() {
    let a = leaf(&[1.0]);
    let copy = a.clone();
    assert_eq!(copy.retired_by(), None);
    a.retire("fully_shard");
    a.retire("reset_parameters");
    assert_eq!(copy.retired_by(), Some("fully_shard"), "the first mark stays");
    // A detached handle is another tensor: a replacement built from the leaf's data.
    assert_eq!(a.detach().retired_by(), None);
    assert_eq!(leaf(&[1.0]).retired_by(), None);
}

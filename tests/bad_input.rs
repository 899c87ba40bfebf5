//! Bad input returns typed errors whose messages name the problem; nothing panics.

use tpar::prelude::*;
use tpar::tensor::Result;

fn msg<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn mismatched_matmul_shapes() {
    let a = Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([4, 5], DType::F32, Device::Cpu).unwrap();
    let m = msg(a.matmul(&b));
    assert!(m.contains("matmul") && m.contains("[2, 3]") && m.contains("[4, 5]"), "{m}");
    assert!(m.contains("inner dims differ: 3 vs 4"), "{m}");
    let m = msg(a.linear(&Tensor::zeros([4, 2], DType::F32, Device::Cpu).unwrap(), None));
    assert!(m.contains("matmul"), "{m}");
}

#[test]
fn wrong_dtype() {
    let a = Tensor::zeros([2, 2], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([2, 2], DType::BF16, Device::Cpu).unwrap();
    let m = msg(a.add(&b));
    assert!(m.contains("add") && m.contains("bf16") && m.contains("f32"), "{m}");
    let ids = Tensor::zeros([2], DType::I64, Device::Cpu).unwrap();
    let m = msg(ids.exp());
    assert!(m.contains("exp") && m.contains("i64"), "{m}");
    let logits = Tensor::zeros([2, 4], DType::F32, Device::Cpu).unwrap();
    let m = msg(logits.cross_entropy(&a.narrow(1, 0, 1).unwrap().reshape([2]).unwrap(), -100));
    assert!(m.contains("cross_entropy") && m.contains("i64"), "{m}");
}

#[test]
fn embedding_index_out_of_range() {
    let w = Tensor::zeros([10, 4], DType::F32, Device::Cpu).unwrap();
    let ids = Tensor::from_vec(vec![1i64, 10, 3], [3]).unwrap();
    let m = msg(Tensor::embedding(&ids, &w));
    assert!(m.contains("embedding") && m.contains("10") && m.contains("out of range"), "{m}");
    let neg = Tensor::from_vec(vec![-1i64], [1]).unwrap();
    assert!(msg(Tensor::embedding(&neg, &w)).contains("-1"));
}

#[test]
fn cross_entropy_target_out_of_range() {
    let logits = Tensor::zeros([2, 4], DType::F32, Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![0i64, 7], [2]).unwrap();
    let m = msg(logits.cross_entropy(&t, -100));
    assert!(m.contains("7") && m.contains("out of range"), "{m}");
}

#[test]
fn shape_and_dim_errors() {
    let a = Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap();
    assert!(msg(a.add(&Tensor::zeros([4], DType::F32, Device::Cpu).unwrap())).contains("broadcast"));
    assert!(msg(a.sum(5, false)).contains("dim 5 out of range"));
    assert!(msg(a.narrow(1, 2, 2)).contains("out of bounds"));
    assert!(msg(a.reshape([7])).contains("element counts differ"));
    assert!(msg(a.permute(&[0, 0])).contains("not a permutation"));
    assert!(msg(Tensor::cat(
        &[a.clone(), Tensor::zeros([3, 3], DType::F32, Device::Cpu).unwrap()],
        1
    ))
    .contains("cat"));
    let x = Tensor::zeros([1, 4, 2, 8], DType::F32, Device::Cpu).unwrap();
    let kv = Tensor::zeros([1, 3, 2, 8], DType::F32, Device::Cpu).unwrap();
    let m = msg(Tensor::scaled_dot_product_attention(&x, &kv, &kv, None, true, None));
    assert!(m.contains("4 query heads are not a multiple of 3 kv heads"), "{m}");
    let m = msg(a.backward());
    assert!(m.contains("one-element"), "{m}");
}

#[test]
fn meta_tensors_have_no_data_but_infer_shapes() {
    let w = Tensor::empty([8, 4], DType::BF16, Device::Meta).unwrap();
    let x = Tensor::empty([2, 4], DType::BF16, Device::Meta).unwrap();
    let y = x.linear(&w, None).unwrap();
    assert_eq!((y.dims(), y.device()), (&[2usize, 8][..], Device::Meta));
    assert!(msg(y.to_vec_f64()).contains("meta"));
    let real = w.to_empty(Device::Cpu).unwrap();
    assert_eq!(real.to_vec_f64().unwrap(), vec![0.0; 32]);
    assert!(msg(w.to_device(Device::Cuda(0))).contains("meta"));
    // no GPU and no emulated device registered in this process: a clear error
    if std::env::var("TPAR_CUDA").is_err() && tpar::kernels::cuda::open_gpu(0).is_err() {
        assert!(msg(real.to_device(Device::Cuda(0))).contains("unavailable"));
    }
}

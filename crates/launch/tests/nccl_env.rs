//! The NCCL world from the launch environment: `EnvInit::nccl_world` and
//! `init_process_group`. Without a GPU and NCCL they must report what is missing (and bind
//! nothing); with them, a world of one runs through rank 0's TCP store.

use std::net::TcpListener;
use std::time::Duration;

use tpar_collectives::{nccl, CollectiveError, ReduceOp};
use tpar_launch::EnvInit;
use tpar_tensor::Tensor;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap()
}

/// A world of one: RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, store on a free local port.
fn env_of_one() -> EnvInit {
    let port = free_port().to_string();
    EnvInit::from_vars(|name| match name {
        "RANK" | "LOCAL_RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some(port.clone()),
        _ => None,
    })
    .unwrap()
}

#[test]
fn nccl_world_is_unavailable_not_a_panic_without_cuda() {
    let p = nccl::probe();
    if p.is_usable() {
        println!("skipped: CUDA and NCCL are present here");
        return;
    }
    let env = env_of_one();
    match env.nccl_world(Duration::from_secs(5)) {
        Err(CollectiveError::Unavailable { what, why }) => {
            println!("nccl_world: {what} is unavailable: {why}");
            assert_eq!(what, "NCCL backend");
            let named = (!p.driver.is_present() && why.contains("CUDA driver"))
                || (!p.nccl.is_present() && why.contains("NCCL missing"));
            assert!(named, "the reason names the missing library: {why}");
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(pg) => panic!("an NCCL group without CUDA: {pg:?}"),
    }
    // Nothing was bound: the store is only created once the libraries are there.
    assert!(TcpListener::bind(("127.0.0.1", env.master_port)).is_ok());
}

#[test]
fn init_process_group_reads_the_environment() {
    if std::env::var_os("RANK").is_some() {
        println!("skipped: launched with a torchrun environment");
        return;
    }
    match tpar_launch::init_process_group(Duration::from_secs(1)) {
        Err(CollectiveError::InvalidArgument { why, .. }) => assert!(why.contains("RANK"), "{why}"),
        other => panic!("expected a missing-environment error, got {other:?}"),
    }
}

#[test]
fn a_world_of_one_through_the_tcp_store() {
    let p = nccl::probe();
    if !p.is_usable() {
        println!("skipped: {}", p.why_unavailable().unwrap_or_default());
        return;
    }
    let env = env_of_one();
    let pg = env.nccl_world(Duration::from_secs(60)).expect("NCCL world of one");
    assert_eq!((pg.backend_name(), pg.size(), pg.rank()), ("nccl", 1, 0));
    let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap();
    let sum = pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    assert_eq!(sum.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    let sub = pg.new_group(&[0]).unwrap();
    sub.barrier().unwrap();
    pg.barrier().unwrap();
}

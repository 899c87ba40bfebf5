//! Checks a multi-process launch: every rank joins the job's rendezvous store
//! (`EnvInit::from_env()?.store(..)`), publishes a value, reads every other rank's, meets
//! the others at a barrier and prints `rank R of W ok`. It needs no GPU and no
//! collectives backend, so it shows whether a launcher's environment works:
//!
//! ```text
//! cargo build --release --example rendezvous_check
//! tpar-run --nproc-per-node 2 target/release/examples/rendezvous_check
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/rendezvous_check
//! srun -N 2 --ntasks-per-node 2 target/release/examples/rendezvous_check
//! ```
//!
//! With `--nccl-mesh DPxTP` it then runs the NCCL backend's bring-up with
//! [`tpar::collectives::nccl::StandIn`] (no GPU needed): the world communicator and a
//! `DPxTP` device mesh's one per axis, over the job's store, exactly as `--backend nccl`
//! would up to its first call into NCCL. It prints one line per communicator
//! (`rank R communicator ranks=0,2 member=0 id=<first 8 bytes of the unique id>`) and
//! where the stand-in stops (`rank R first collective: ...`).

use std::sync::Arc;
use std::time::Duration;

use tpar::collectives::nccl::StandIn;
use tpar::collectives::ReduceOp;
use tpar::launch::{EnvInit, TcpStore};
use tpar::mesh::{DeviceMesh, DeviceType};
use tpar::tensor::Tensor;

fn main() -> std::process::ExitCode {
    match check() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rendezvous_check: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn check() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mesh = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => None,
        ["--nccl-mesh", m] => {
            let parsed =
                m.split_once('x').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
            Some(parsed.ok_or_else(|| format!("--nccl-mesh takes DPxTP (e.g. 2x2), not {m:?}"))?)
        }
        _ => return Err(format!("unexpected arguments {args:?} (only --nccl-mesh DPxTP)").into()),
    };
    let env = EnvInit::from_env()?;
    let store = env.store(Duration::from_secs(60))?;
    store.set(&format!("rendezvous_check/{}", env.rank), env.rank.to_string().as_bytes())?;
    for r in 0..env.world_size {
        let v = store.get(&format!("rendezvous_check/{r}"))?;
        assert_eq!(v, r.to_string().into_bytes(), "rank {r}'s value");
    }
    store.barrier("rendezvous_check")?;
    println!(
        "rank {} of {} ok (local rank {}, store {}, launched by {:?}{})",
        env.rank,
        env.world_size,
        env.local_rank,
        store.addr(),
        env.source,
        if env.agent_store { ", through torchrun's agent store" } else { "" }
    );
    let store = Arc::new(store);
    if let Some((dp, tp)) = mesh {
        nccl_bringup(store.clone(), env.rank, env.world_size, dp, tp)?;
    }
    // Rank 0 hosts the store: nobody leaves before everyone has read.
    store.barrier("exit")?;
    Ok(())
}

/// NCCL's bring-up of the world and a `dp x tp` mesh through the stand-in.
fn nccl_bringup(
    store: Arc<TcpStore>,
    rank: usize,
    world_size: usize,
    dp: usize,
    tp: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let (world, standin) = StandIn::world(store, rank, world_size, Duration::from_secs(60))?;
    let mesh = DeviceMesh::new(&world, DeviceType::Cuda, &[dp, tp], &["dp", "tp"])?;
    for c in standin.communicators() {
        let ranks: Vec<String> = c.ranks.iter().map(usize::to_string).collect();
        let id: String = c.unique_id[..8].iter().map(|b| format!("{b:02x}")).collect();
        println!("rank {rank} communicator ranks={} member={} id={id}", ranks.join(","), c.member);
    }
    let x = Tensor::from_vec(vec![1.0f32], [1])?;
    match mesh.group_of("tp")?.all_reduce(&x, ReduceOp::Sum) {
        Ok(_) => Err("the stand-in ran a collective".into()),
        Err(e) => {
            println!("rank {rank} first collective: {e}");
            Ok(())
        }
    }
}

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

use std::time::Duration;

use tpar::launch::EnvInit;

fn main() -> std::process::ExitCode {
    match check() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rendezvous_check: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn check() -> Result<(), tpar::launch::RendezvousError> {
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
    // Rank 0 hosts the store: nobody leaves before everyone has read.
    store.barrier("exit")?;
    Ok(())
}

//! The tracking allocator credits each rank's allocations to it, including blocks
//! freed on another thread, and records peaks.

#[global_allocator]
static ALLOC: tpar::tensor::memory::TrackingAllocator = tpar::tensor::memory::TrackingAllocator;

use tpar::tensor::memory;

#[test]
fn allocations_are_credited_per_rank() {
    let out =
        tpar::spawn(2, |ctx| -> Result<(i64, i64, i64), tpar::collectives::CollectiveError> {
            let r = ctx.rank();
            memory::reset_peak(r);
            let before = memory::current(r);
            let big = vec![0u8; (r + 1) << 20]; // 1 MiB on rank 0, 2 MiB on rank 1
            let during = memory::current(r) - before;
            drop(big);
            let after = memory::current(r) - before;
            Ok((during, after, memory::peak(r) - before))
        })
        .unwrap();
    assert!(memory::is_tracking());
    for (r, (during, after, peak)) in out.into_iter().enumerate() {
        let want = ((r + 1) << 20) as i64;
        assert!(during >= want && during < want + (64 << 10), "rank {r}: {during}");
        assert!(after.abs() < 64 << 10, "rank {r}: {after} left after free");
        assert!(peak >= want, "rank {r}: peak {peak}");
    }
    // A block allocated on one thread and freed on another is credited back to its owner.
    memory::set_rank(Some(7));
    let before = memory::current(7);
    let v = vec![1u8; 1 << 20];
    memory::set_rank(None);
    std::thread::spawn(move || drop(v)).join().unwrap();
    assert!((memory::current(7) - before).abs() < 4096);
}

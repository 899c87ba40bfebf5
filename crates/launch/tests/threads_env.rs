//! `OMP_NUM_THREADS` sizes a rank process's kernel threads (its own test binary: the
//! global pool can be sized once per process).

#[test]
fn omp_num_threads_sizes_the_kernel_pool() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        println!("skipped: RAYON_NUM_THREADS is set and takes precedence");
        return;
    }
    // What torchrun and tpar-run set for each of several ranks on a node.
    std::env::set_var("OMP_NUM_THREADS", "1");
    assert_eq!(tpar_launch::threads_from_env(), Some(1));
    assert_eq!(rayon::current_num_threads(), 1);
    // The pool is sized once: later calls leave it alone.
    std::env::set_var("OMP_NUM_THREADS", "3");
    assert_eq!(tpar_launch::threads_from_env(), None);
    assert_eq!(rayon::current_num_threads(), 1);
}

//! Parquet datasets (tests/golden/parquet, written by pyarrow with
//! tests/golden/make_parquet_golden.py): the documents equal the JSON-lines file's; the
//! batches each data-parallel rank streams equal the batches of the text path
//! (`PretrainingDataset` over the JSON-lines documents, split by an unshuffled
//! `DistributedSampler` with drop_last) for dp 1, 2 and 3, from one file and from a
//! directory of shards; a stream resumed from its saved state (through a checkpoint, and
//! with another dp degree) reads the next batch an uninterrupted one reads; bad files are
//! typed errors naming the file and the column. The trainers `llama_2d` and `llama_pp`,
//! which stream parquet `--data` (`--data DIR --text-column content`), end with the loss
//! bits of the same run on the JSON-lines file read in order (`--no-shuffle`), and
//! `llama_2d` interrupted and resumed from a checkpoint, inside the first epoch and
//! inside the second, ends with the uninterrupted run's.

mod common;

use std::path::{Path, PathBuf};

use common::examples::run_example;

use tpar::checkpoint::{CheckpointConfig, CheckpointManager};
use tpar::data::{
    load_documents, load_documents_with_column, Batch, ParquetDocuments, ParquetProblem,
};
use tpar::prelude::*;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/parquet").join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tpar-parquet-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ids(b: &Batch) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    (
        b.input_ids.to_vec::<i64>().unwrap(),
        b.target_ids.to_vec::<i64>().unwrap(),
        b.attention_mask.to_vec::<i64>().unwrap(),
    )
}

const SEQ: usize = 24;

#[test]
fn parquet_documents_equal_the_jsonl_documents() {
    let want = load_documents(&golden("docs.jsonl")).unwrap();
    assert_eq!(want.len(), 41);
    assert_eq!(load_documents(&golden("docs.parquet")).unwrap(), want);
    // A directory of shards (snappy and zstd files, another column name), in file order.
    assert_eq!(load_documents_with_column(&golden("shards"), "content").unwrap(), want);
    let docs = ParquetDocuments::open(&golden("docs.parquet"), "text").unwrap();
    assert_eq!(docs.num_rows().unwrap(), 41);
}

/// Every batch rank `rank` of `dp` streams from `path` equals the text path's batch of
/// the same step, and the stream ends where the sampler's epoch does.
fn check_ranks(path: &Path, column: &str, dp: usize, batch: usize) {
    let docs = load_documents(&golden("docs.jsonl")).unwrap();
    let ds = PretrainingDataset::new(&docs, &ByteTokenizer, SEQ).unwrap();
    for rank in 0..dp {
        let sampler =
            DistributedSampler::new(dp, rank).unwrap().with_shuffle(false).with_drop_last(true);
        let idx = sampler.indices(ds.len());
        let mut stream = ParquetDocuments::open(path, column).unwrap().for_rank(dp, rank).unwrap();
        let mut n = 0;
        for chunk in idx.chunks(batch) {
            let got = stream.next_batch(chunk.len(), &ByteTokenizer, SEQ).unwrap();
            let got = got.unwrap_or_else(|| panic!("dp {dp} rank {rank}: ended at batch {n}"));
            assert_eq!(ids(&got), ids(&ds.batch(chunk).unwrap()), "dp {dp} rank {rank} batch {n}");
            n += 1;
        }
        assert!(n > 0);
        assert!(
            stream.next_document().unwrap().is_none(),
            "dp {dp} rank {rank}: documents past the sampler's epoch"
        );
    }
}

#[test]
fn each_rank_streams_the_text_paths_tokens() {
    for dp in [1, 2, 3] {
        check_ranks(&golden("docs.parquet"), "text", dp, 4);
        check_ranks(&golden("shards"), "content", dp, 3);
    }
}

#[test]
fn a_resumed_stream_reads_the_next_batch_of_an_uninterrupted_one() {
    let path = golden("docs.parquet");
    let open = |dp, rank| {
        ParquetDocuments::open(&path, "text").unwrap().for_rank(dp, rank).unwrap().with_repeat(true)
    };
    // Stop inside a row group, after a row group boundary, and in the second epoch.
    for stop in [1usize, 3, 7, 12] {
        for rank in 0..2 {
            let mut a = open(2, rank);
            for _ in 0..stop {
                a.next_batch(3, &ByteTokenizer, SEQ).unwrap().unwrap();
            }
            let state = a.state_dict().unwrap();
            let want = ids(&a.next_batch(3, &ByteTokenizer, SEQ).unwrap().unwrap());
            let mut b = open(2, rank);
            b.load_state_dict(state.clone()).unwrap();
            let got = ids(&b.next_batch(3, &ByteTokenizer, SEQ).unwrap().unwrap());
            assert_eq!(got, want, "stop {stop} rank {rank}");
            assert_eq!(b.epoch(), a.epoch());
            // Every rank saves the same position (the other rank's state, but for its
            // recorded rank, equals this one's).
            assert_eq!(format!("{state:?}"), format!("{:?}", other_rank_state(&path, stop, rank)));
        }
        // Resumed with dp 1: the next documents are the two ranks' next, interleaved.
        let mut two: Vec<_> = (0..2).map(|r| open(2, r)).collect();
        for s in &mut two {
            for _ in 0..stop {
                s.next_documents(3).unwrap().unwrap();
            }
        }
        let mut one = open(1, 0);
        one.load_state_dict(two[0].state_dict().unwrap()).unwrap();
        let next: Vec<Vec<String>> =
            two.iter_mut().map(|s| s.next_documents(2).unwrap().unwrap()).collect();
        let want =
            vec![next[0][0].clone(), next[1][0].clone(), next[0][1].clone(), next[1][1].clone()];
        assert_eq!(one.next_documents(4).unwrap().unwrap(), want, "stop {stop}, dp 2 -> 1");
    }
}

/// The state of the rank of 2 other than `rank` after `stop` batches of 3, with its
/// recorded rank replaced by `rank`.
fn other_rank_state(path: &Path, stop: usize, rank: usize) -> StateDict {
    let mut s = ParquetDocuments::open(path, "text")
        .unwrap()
        .for_rank(2, 1 - rank)
        .unwrap()
        .with_repeat(true);
    for _ in 0..stop {
        s.next_batch(3, &ByteTokenizer, SEQ).unwrap().unwrap();
    }
    let mut st = s.state_dict().unwrap();
    st.insert("rank".into(), StateValue::Int(rank as i64));
    st
}

#[test]
fn the_position_resumes_through_a_checkpoint() {
    let dir = tmp("ckpt");
    let path = golden("shards");
    let d = dir.clone();
    spawn(2, move |ctx| -> tpar::Result<()> {
        let g = ctx.world_group();
        let open = || -> tpar::Result<ParquetDocuments> {
            Ok(ParquetDocuments::open(&path, "content")?.for_rank(2, g.rank())?.with_repeat(true))
        };
        let mut a = open()?;
        for _ in 0..5 {
            a.next_batch(2, &ByteTokenizer, SEQ)?;
        }
        let mut manager = CheckpointManager::new(&d, &g, CheckpointConfig::default())?;
        manager.save(5, &mut [("data", &mut a as &mut dyn Stateful)])?;
        let want = ids(&a.next_batch(2, &ByteTokenizer, SEQ)?.unwrap());
        let mut b = open()?;
        let step = manager.load_latest(&mut [("data", &mut b as &mut dyn Stateful)])?;
        assert_eq!(step, Some(5));
        assert_eq!(ids(&b.next_batch(2, &ByteTokenizer, SEQ)?.unwrap()), want);
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn parquet_problem(r: Result<impl std::fmt::Debug, DataError>) -> (String, String, ParquetProblem) {
    match r {
        Err(DataError::Parquet { file, column, problem }) => (file, column, problem),
        other => panic!("expected a parquet error, got {other:?}"),
    }
}

#[test]
fn bad_parquet_inputs_are_typed_errors_naming_file_and_column() {
    let no_text = golden("bad/no_text.parquet");
    let (file, column, p) = parquet_problem(ParquetDocuments::open(&no_text, "text"));
    assert!(file.ends_with("no_text.parquet"), "{file}");
    assert_eq!(column, "text");
    assert_eq!(p, ParquetProblem::MissingColumn { columns: vec!["id".into(), "body".into()] });
    let e = load_documents(&no_text).unwrap_err().to_string();
    assert!(e.contains("no_text.parquet") && e.contains("\"text\"") && e.contains("body"), "{e}");

    let (file, column, p) =
        parquet_problem(ParquetDocuments::open(&golden("bad/int_text.parquet"), "text"));
    assert!(file.ends_with("int_text.parquet") && column == "text");
    assert!(matches!(&p, ParquetProblem::NotString { found } if found.contains("INT64")), "{p}");
    // Another column of the right file that is not strings.
    let (_, column, p) = parquet_problem(ParquetDocuments::open(&golden("docs.parquet"), "id"));
    assert_eq!(column, "id");
    assert!(matches!(p, ParquetProblem::NotString { .. }));

    // A null is found when its row group is read, naming the row.
    let mut nulls = ParquetDocuments::open(&golden("bad/null_text.parquet"), "text").unwrap();
    let (file, _, p) = parquet_problem(nulls.next_documents(5));
    assert!(file.ends_with("null_text.parquet"));
    assert_eq!(p, ParquetProblem::Null { row: 3 });

    let dir = tmp("bad");
    let garbage = dir.join("garbage.parquet");
    std::fs::write(&garbage, b"this is not a parquet file at all").unwrap();
    let (file, column, p) = parquet_problem(ParquetDocuments::open(&garbage, "text"));
    assert!(file.ends_with("garbage.parquet") && column == "text");
    assert!(matches!(p, ParquetProblem::Unreadable(_)), "{p}");
    // A directory is read whole: one bad file fails it, naming that file.
    std::fs::copy(golden("docs.parquet"), dir.join("a.parquet")).unwrap();
    let (file, ..) = parquet_problem(ParquetDocuments::open(&dir, "text"));
    assert!(file.ends_with("garbage.parquet"), "{file}");
    let e = ParquetDocuments::open(&dir.join("missing.parquet"), "text").unwrap_err();
    assert!(e.to_string().contains("missing.parquet"), "{e}");
    let empty = tmp("empty");
    assert!(ParquetDocuments::open(&empty, "text").is_err());

    // A position saved over other files is refused.
    let mut s = ParquetDocuments::open(&golden("docs.parquet"), "text").unwrap();
    s.next_documents(2).unwrap();
    let state = s.state_dict().unwrap();
    let mut other = ParquetDocuments::open(&golden("shards"), "content").unwrap();
    assert!(other.load_state_dict(state).is_err());
    assert!(ParquetDocuments::open(&golden("docs.parquet"), "text")
        .unwrap()
        .for_rank(2, 2)
        .is_err());
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}

/// `key=VALUE` of the summary line.
fn summary(out: &str, key: &str) -> String {
    let line = out.lines().find(|l| l.starts_with("summary:")).expect("a summary line");
    let v = line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")));
    v.unwrap_or_else(|| panic!("{key} in {line}")).to_string()
}

#[test]
fn the_trainers_stream_parquet_as_they_read_the_same_jsonl_in_order() {
    let base = ["--steps", "3", "--batch", "2", "--seq", "32", "--layers", "1", "--log-every", "1"];
    let jsonl = golden("docs.jsonl");
    let shards = golden("shards");
    let in_order = ["--data", jsonl.to_str().unwrap(), "--no-shuffle"];
    let streamed = ["--data", shards.to_str().unwrap(), "--text-column", "content"];
    for (example, own) in [("llama_2d", &[][..]), ("llama_pp", &["--microbatches", "2"][..])] {
        let run = |data: &[&str]| run_example(example, &[&base[..], own, data].concat());
        let Some((code, out, err)) = run(&in_order) else {
            eprintln!("{example} is not built: skipped");
            continue;
        };
        assert_eq!(code, 0, "{out}\n{err}");
        let want = summary(&out, "final_loss_bits");
        let (code, out, err) = run(&streamed).unwrap();
        assert_eq!(code, 0, "{out}\n{err}");
        assert_eq!(summary(&out, "final_loss_bits"), want, "{example}");
        // The order is what was read: the same documents shuffled end elsewhere.
        let (code, out, err) = run(&in_order[..2]).unwrap();
        assert_eq!(code, 0, "{out}\n{err}");
        assert_ne!(summary(&out, "final_loss_bits"), want, "{example}");
    }
    // The default column is `text`, which the shards lack: an error naming both.
    if let Some((code, out, err)) = run_example("llama_2d", &[&base[..], &streamed[..2]].concat()) {
        assert_eq!(code, 1, "{out}\n{err}");
        assert!(err.contains("train-00000-of-00003.parquet") && err.contains("\"text\""), "{err}");
        assert!(err.contains("content"), "{err}");
    }
}

/// `llama_2d` on the parquet shards at dp 2 x tp 2, 12 steps of 2 sequences per rank
/// (48 documents of 41: the stream wraps into a second epoch), interrupted after step 5
/// (inside the first epoch) or step 10 (inside the second) and resumed from its checkpoint,
/// ends with the uninterrupted run's loss bits; the data position is the stream's.
#[test]
fn llama_2d_resumes_a_parquet_stream_where_it_stopped() {
    let shards = golden("shards");
    let base = [
        "--steps",
        "12",
        "--batch",
        "2",
        "--seq",
        "32",
        "--layers",
        "1",
        "--log-every",
        "1",
        "--data",
        shards.to_str().unwrap(),
        "--text-column",
        "content",
    ];
    let Some((code, out, err)) = run_example("llama_2d", &base) else {
        eprintln!("llama_2d is not built: skipped");
        return;
    };
    assert_eq!(code, 0, "{out}\n{err}");
    let want = summary(&out, "final_loss_bits");
    assert!(out.contains("epoch  1 step   12/12"), "the stream wraps:\n{out}");
    for stop in ["5", "10"] {
        let dir = tmp(&format!("resume-{stop}"));
        let ckpt = ["--checkpoint-dir", dir.to_str().unwrap(), "--save-every", "1"];
        let first = [&base[..], &ckpt[..], &["--stop-after", stop][..]].concat();
        let (code, out, err) = run_example("llama_2d", &first).unwrap();
        assert_eq!(code, 0, "{out}\n{err}");
        let (code, out, err) = run_example("llama_2d", &[&base[..], &ckpt[..]].concat()).unwrap();
        assert_eq!(code, 0, "{out}\n{err}");
        assert!(out.contains(&format!("at step {stop}")), "{out}");
        assert_eq!(summary(&out, "final_loss_bits"), want, "resumed after step {stop}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

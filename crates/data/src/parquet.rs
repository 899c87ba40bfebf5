//! Documents from parquet files, the on-disk form of Hugging Face `datasets`: one string
//! column (`text` by default) of one file or of every `.parquet` file under a directory,
//! read by the `parquet` crate's column readers (no arrow) one row group at a time.
//!
//! [`ParquetDocuments`] streams the documents: it holds the strings of one row group at
//! a time (never a whole file), splits them over data-parallel ranks (document `g` of the
//! stream goes to rank `g % num_replicas`, and a last round that does not fill every rank
//! is dropped, so every rank reads as many documents: `DistributedSampler`'s order without
//! shuffling, with `drop_last`), and keeps its position as state ([`Stateful`]) for a
//! checkpoint to resume from. Its [`ParquetDocuments::next_batch`] frames, tokenizes and
//! pads documents exactly as [`PretrainingDataset`] does, so the tokens equal those of
//! the same documents read from text or JSON lines.
//!
//! Pages may be uncompressed, snappy (pyarrow's default) or zstd; another codec is an
//! error naming the file.
//!
//! ```no_run
//! use tpar_data::{ByteTokenizer, ParquetDocuments};
//! // dp rank 1 of 2, the `text` column of every parquet file under `data/`.
//! let mut docs = ParquetDocuments::open("data".as_ref(), "text")?.for_rank(2, 1)?;
//! let batch = docs.next_batch(4, &ByteTokenizer, 128)?;
//! # Ok::<(), tpar_data::DataError>(())
//! ```

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use ::parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use ::parquet::column::reader::ColumnReader;
use ::parquet::data_type::ByteArray;
use ::parquet::file::reader::FileReader;
use ::parquet::file::serialized_reader::SerializedFileReader;
use tpar_tensor::state::{
    expect_empty, take_int, take_text, StateDict, StateDictError, StateValue, Stateful,
};

use crate::{config_err, Batch, DataError, PretrainingDataset, Result, Tokenizer};

/// What is wrong with a parquet file (in [`DataError::Parquet`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParquetProblem {
    /// The file cannot be opened or read, or is not parquet (the reason as given).
    Unreadable(String),
    /// No top-level column of that name; the file's top-level columns.
    MissingColumn {
        /// The file's top-level column names.
        columns: Vec<String>,
    },
    /// The column holds something other than strings (its parquet type).
    NotString {
        /// The column's type as parquet names it (physical and logical).
        found: String,
    },
    /// A null where a document was expected (row of the file, from 0).
    Null {
        /// The row.
        row: u64,
    },
    /// A value that is not UTF-8 (row of the file, from 0).
    NotUtf8 {
        /// The row.
        row: u64,
    },
}

impl fmt::Display for ParquetProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParquetProblem::Unreadable(why) => write!(f, "unreadable: {why}"),
            ParquetProblem::MissingColumn { columns } => {
                write!(f, "no such column (the file has: {})", columns.join(", "))
            }
            ParquetProblem::NotString { found } => {
                write!(f, "not a string column (it holds {found})")
            }
            ParquetProblem::Null { row } => write!(f, "null at row {row}"),
            ParquetProblem::NotUtf8 { row } => write!(f, "value at row {row} is not UTF-8"),
        }
    }
}

fn parquet_err(file: &Path, column: &str, problem: ParquetProblem) -> DataError {
    DataError::Parquet { file: file.display().to_string(), column: column.to_string(), problem }
}

fn unreadable(file: &Path, column: &str, why: impl fmt::Display) -> DataError {
    parquet_err(file, column, ParquetProblem::Unreadable(why.to_string()))
}

/// Whether `--data PATH` names parquet: a `.parquet` file, or a directory (of parquet
/// files).
pub fn is_parquet(path: &Path) -> bool {
    path.is_dir() || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// The parquet files of `path`: the file itself, or every `*.parquet` file under the
/// directory (recursively), sorted by path, which fixes the order of the documents.
pub fn parquet_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        if !path.exists() {
            return Err(config_err(format!("parquet data {}: no such file", path.display())));
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let mut dirs = vec![path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| {
            config_err(format!("cannot list parquet directory {}: {e}", dir.display()))
        })?;
        for entry in entries {
            let p = entry
                .map_err(|e| config_err(format!("cannot list {}: {e}", dir.display())))?
                .path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet")) {
                files.push(p);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(config_err(format!("{}: no .parquet file in the directory", path.display())));
    }
    Ok(files)
}

/// One opened file: its reader, the leaf index of the column and its row groups' rows.
struct OpenFile {
    reader: SerializedFileReader<File>,
    leaf: usize,
    /// Rows of each row group.
    group_rows: Vec<usize>,
}

fn open_file(path: &Path, column: &str) -> Result<OpenFile> {
    let file = File::open(path).map_err(|e| unreadable(path, column, e))?;
    let reader = SerializedFileReader::new(file).map_err(|e| unreadable(path, column, e))?;
    let meta = reader.metadata();
    let schema = meta.file_metadata().schema_descr();
    let top: Vec<String> =
        schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
    if !top.iter().any(|n| n == column) {
        return Err(parquet_err(path, column, ParquetProblem::MissingColumn { columns: top }));
    }
    let leaf = schema.columns().iter().position(|c| c.path().parts() == [column.to_string()]);
    let Some(leaf) = leaf else {
        // A group (a list, a struct): not a leaf of its own.
        let found = "a nested group".to_string();
        return Err(parquet_err(path, column, ParquetProblem::NotString { found }));
    };
    let desc = schema.column(leaf);
    let utf8 = matches!(desc.logical_type_ref(), Some(LogicalType::String))
        || desc.converted_type() == ConvertedType::UTF8;
    if desc.physical_type() != PhysicalType::BYTE_ARRAY || !utf8 || desc.max_rep_level() != 0 {
        let logical = desc.logical_type_ref().map_or("none".to_string(), |l| format!("{l:?}"));
        let found = format!(
            "{} (logical type {logical}{})",
            desc.physical_type(),
            if desc.max_rep_level() > 0 { ", repeated" } else { "" }
        );
        return Err(parquet_err(path, column, ParquetProblem::NotString { found }));
    }
    let group_rows = meta.row_groups().iter().map(|g| g.num_rows().max(0) as usize).collect();
    Ok(OpenFile { reader, leaf, group_rows })
}

/// Reads the strings of the column in row group `group` of `f` (`first_row`: the file
/// row of its first row, for errors).
fn read_group(
    f: &OpenFile,
    path: &Path,
    column: &str,
    group: usize,
    first_row: u64,
) -> Result<Vec<String>> {
    let rows = f.group_rows[group];
    let rg = f.reader.get_row_group(group).map_err(|e| unreadable(path, column, e))?;
    let ColumnReader::ByteArrayColumnReader(mut reader) =
        rg.get_column_reader(f.leaf).map_err(|e| unreadable(path, column, e))?
    else {
        let found = "a non-byte-array column".to_string();
        return Err(parquet_err(path, column, ParquetProblem::NotString { found }));
    };
    let mut texts = Vec::with_capacity(rows);
    let mut values: Vec<ByteArray> = Vec::new();
    let mut defs: Vec<i16> = Vec::new();
    let max_def = rg.metadata().column(f.leaf).column_descr().max_def_level();
    while texts.len() < rows {
        values.clear();
        defs.clear();
        let want = (rows - texts.len()).min(4096);
        let (records, _, _) = reader
            .read_records(want, Some(&mut defs), None, &mut values)
            .map_err(|e| unreadable(path, column, e))?;
        if records == 0 {
            let why = format!("row group {group} ends after {} of {rows} rows", texts.len());
            return Err(unreadable(path, column, why));
        }
        let mut vals = values.drain(..);
        for i in 0..records {
            let row = first_row + texts.len() as u64;
            if max_def > 0 && defs.get(i).is_some_and(|&d| d < max_def) {
                return Err(parquet_err(path, column, ParquetProblem::Null { row }));
            }
            let v =
                vals.next().ok_or_else(|| unreadable(path, column, "fewer values than rows"))?;
            let s = String::from_utf8(v.data().to_vec())
                .map_err(|_| parquet_err(path, column, ParquetProblem::NotUtf8 { row }))?;
            texts.push(s);
        }
    }
    Ok(texts)
}

/// Where a stream stands: the next document to read, by epoch, file, row group and row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Position {
    epoch: u64,
    file: usize,
    group: usize,
    row: usize,
}

/// A stream of the documents of one string column of parquet files, read one row group
/// at a time, split over data-parallel ranks, resumable (see the module docs).
///
/// Its state ([`Stateful`]) is the position of the next document to read: `epoch`,
/// `file` (an index into the sorted file list, with `file_name` to check it on load),
/// `row_group`, `row`, and `documents` read in all by every rank together. The position
/// is taken at round boundaries, so every rank of a run saves the same state and a run
/// may resume with another data-parallel degree.
pub struct ParquetDocuments {
    files: Vec<PathBuf>,
    column: String,
    num_replicas: usize,
    rank: usize,
    repeat: bool,
    pos: Position,
    /// Documents read by all ranks together (the stream's global index of `pos`).
    documents: u64,
    /// Whether the current epoch yielded a document (an empty pass with `repeat` ends).
    epoch_had_docs: bool,
    open: Option<(usize, OpenFile)>,
    /// The strings of row group `(file, group)`; taken out as they are read.
    group: Option<(usize, usize, Vec<String>)>,
}

impl fmt::Debug for ParquetDocuments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParquetDocuments")
            .field("files", &self.files)
            .field("column", &self.column)
            .field("num_replicas", &self.num_replicas)
            .field("rank", &self.rank)
            .field("repeat", &self.repeat)
            .field("pos", &self.pos)
            .field("documents", &self.documents)
            .finish_non_exhaustive()
    }
}

impl ParquetDocuments {
    /// The documents of `column` in `path` (a `.parquet` file, or a directory whose
    /// `.parquet` files are read in sorted order), for one rank of one (set the split with
    /// [`ParquetDocuments::for_rank`]). Every file's footer is read and its column checked
    /// now: a missing column, a column that is not strings or an unreadable file is a
    /// [`DataError::Parquet`] naming the file and the column.
    pub fn open(path: &Path, column: &str) -> Result<ParquetDocuments> {
        let files = parquet_files(path)?;
        for f in &files {
            open_file(f, column)?;
        }
        Ok(ParquetDocuments {
            files,
            column: column.to_string(),
            num_replicas: 1,
            rank: 0,
            repeat: false,
            pos: Position::default(),
            documents: 0,
            epoch_had_docs: false,
            open: None,
            group: None,
        })
    }

    /// This stream for data-parallel `rank` of `num_replicas`: it reads documents `rank`,
    /// `rank + num_replicas`, ... of the files.
    pub fn for_rank(mut self, num_replicas: usize, rank: usize) -> Result<ParquetDocuments> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(config_err(format!(
                "ParquetDocuments: invalid rank {rank} of {num_replicas} replicas"
            )));
        }
        self.num_replicas = num_replicas;
        self.rank = rank;
        Ok(self)
    }

    /// Starts over at the first file at the end of the last one (a new epoch), instead
    /// of ending; an epoch without a document then is an error.
    pub fn with_repeat(mut self, repeat: bool) -> ParquetDocuments {
        self.repeat = repeat;
        self
    }

    /// The files read, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The column read.
    pub fn column(&self) -> &str {
        &self.column
    }

    /// The epoch (passes over the files completed).
    pub fn epoch(&self) -> u64 {
        self.pos.epoch
    }

    /// Documents read so far by all ranks together (including those a rank skipped
    /// because they were another's).
    pub fn documents_read(&self) -> u64 {
        self.documents
    }

    /// Rows in all files, from their footers (no data read).
    pub fn num_rows(&self) -> Result<u64> {
        let mut n = 0u64;
        for f in &self.files {
            n += open_file(f, &self.column)?.group_rows.iter().map(|&r| r as u64).sum::<u64>();
        }
        Ok(n)
    }

    /// The next document of the whole stream (every rank's), `None` at the end.
    fn next_global(&mut self) -> Result<Option<String>> {
        loop {
            let Position { file, group, row, .. } = self.pos;
            if let Some((f, g, texts)) = &mut self.group {
                if (*f, *g) == (file, group) && row < texts.len() {
                    let text = std::mem::take(&mut texts[row]);
                    self.pos.row += 1;
                    self.documents += 1;
                    self.epoch_had_docs = true;
                    return Ok(Some(text));
                }
            }
            if file >= self.files.len() {
                if !self.repeat {
                    return Ok(None);
                }
                if !self.epoch_had_docs {
                    return Err(config_err(format!(
                        "parquet data: no document in column \"{}\" of {} file(s)",
                        self.column,
                        self.files.len()
                    )));
                }
                self.pos = Position { epoch: self.pos.epoch + 1, ..Position::default() };
                self.epoch_had_docs = false;
                continue;
            }
            if self.open.as_ref().is_none_or(|(i, _)| *i != file) {
                self.group = None;
                self.open = Some((file, open_file(&self.files[file], &self.column)?));
            }
            let Some((_, of)) = &self.open else { unreachable!("opened above") };
            if group >= of.group_rows.len() {
                self.pos = Position { file: file + 1, group: 0, row: 0, ..self.pos };
                continue;
            }
            if row >= of.group_rows[group] {
                self.pos = Position { group: group + 1, row: 0, ..self.pos };
                continue;
            }
            let first_row: u64 = of.group_rows[..group].iter().map(|&r| r as u64).sum();
            let texts = read_group(of, &self.files[file], &self.column, group, first_row)?;
            self.group = Some((file, group, texts));
        }
    }

    /// This rank's next document: one round of `num_replicas` documents is read and this
    /// rank's kept. `None` at the end (without repeat), including when the last round
    /// does not reach every rank (its documents are dropped, so ranks read alike).
    pub fn next_document(&mut self) -> Result<Option<String>> {
        let mut mine = None;
        for i in 0..self.num_replicas {
            match self.next_global()? {
                Some(t) if i == self.rank => mine = Some(t),
                Some(_) => {}
                None => return Ok(None),
            }
        }
        Ok(mine)
    }

    /// This rank's next `n` documents, or `None` when the stream ends before `n`.
    pub fn next_documents(&mut self, n: usize) -> Result<Option<Vec<String>>> {
        let mut docs = Vec::with_capacity(n);
        while docs.len() < n {
            match self.next_document()? {
                Some(d) => docs.push(d),
                None => return Ok(None),
            }
        }
        Ok(Some(docs))
    }

    /// This rank's next batch of `batch` documents, framed, tokenized and padded to
    /// `seq_length` as [`PretrainingDataset`] does (so [`PretrainingDataset::batch`] of
    /// the same documents is equal), or `None` when the stream ends before `batch`.
    pub fn next_batch(
        &mut self,
        batch: usize,
        tokenizer: &dyn Tokenizer,
        seq_length: usize,
    ) -> Result<Option<Batch>> {
        if batch == 0 {
            return Err(config_err("ParquetDocuments::next_batch: batch must be at least 1"));
        }
        let Some(docs) = self.next_documents(batch)? else { return Ok(None) };
        let ds = PretrainingDataset::new(&docs, tokenizer, seq_length)?;
        let indices: Vec<usize> = (0..batch).collect();
        ds.batch(&indices).map(Some)
    }

    /// Every document of the files, in order (one rank of one), for a trainer that keeps
    /// the documents in memory.
    pub fn read_all(path: &Path, column: &str) -> Result<Vec<String>> {
        let mut docs = ParquetDocuments::open(path, column)?;
        let mut out = Vec::new();
        while let Some(d) = docs.next_global()? {
            out.push(d);
        }
        Ok(out)
    }

    fn file_name(&self, file: usize) -> String {
        self.files
            .get(file)
            .and_then(|p| p.file_name())
            .map_or(String::new(), |n| n.to_string_lossy().into_owned())
    }
}

fn invalid(key: &str, what: String) -> StateDictError {
    StateDictError::Invalid { key: key.to_string(), what }
}

fn take_count(state: &mut StateDict, key: &str) -> std::result::Result<u64, StateDictError> {
    let v = take_int(state, key)?;
    u64::try_from(v).map_err(|_| invalid(key, format!("{v} is negative")))
}

/// The stream's position (see [`ParquetDocuments`]); `num_replicas` and `rank` are kept
/// for the record (a run may resume with another split).
impl Stateful for ParquetDocuments {
    fn state_dict(&self) -> std::result::Result<StateDict, StateDictError> {
        Ok(StateDict::from([
            ("epoch".to_string(), StateValue::Int(self.pos.epoch as i64)),
            ("file".to_string(), StateValue::Int(self.pos.file as i64)),
            ("file_name".to_string(), StateValue::Text(self.file_name(self.pos.file))),
            ("row_group".to_string(), StateValue::Int(self.pos.group as i64)),
            ("row".to_string(), StateValue::Int(self.pos.row as i64)),
            ("documents".to_string(), StateValue::Int(self.documents as i64)),
            ("column".to_string(), StateValue::Text(self.column.clone())),
            ("num_replicas".to_string(), StateValue::Int(self.num_replicas as i64)),
            ("rank".to_string(), StateValue::Int(self.rank as i64)),
        ]))
    }

    fn load_state_dict(&mut self, mut state: StateDict) -> std::result::Result<(), StateDictError> {
        let epoch = take_count(&mut state, "epoch")?;
        let file = take_count(&mut state, "file")? as usize;
        let file_name = take_text(&mut state, "file_name")?;
        let group = take_count(&mut state, "row_group")? as usize;
        let row = take_count(&mut state, "row")? as usize;
        let documents = take_count(&mut state, "documents")?;
        let column = take_text(&mut state, "column")?;
        for k in ["num_replicas", "rank"] {
            take_int(&mut state, k)?;
        }
        expect_empty(state)?;
        if file > self.files.len() {
            return Err(invalid(
                "file",
                format!("file {file}, but the data has {} file(s)", self.files.len()),
            ));
        }
        if file_name != self.file_name(file) {
            return Err(invalid(
                "file_name",
                format!(
                    "the checkpoint's file {file} is {file_name:?}, this data's is {:?}",
                    self.file_name(file)
                ),
            ));
        }
        if column != self.column {
            return Err(invalid(
                "column",
                format!("the checkpoint read column {column:?}, this stream {:?}", self.column),
            ));
        }
        self.pos = Position { epoch, file, group, row };
        self.documents = documents;
        self.epoch_had_docs = (file, group, row) != (0, 0, 0);
        self.group = None;
        Ok(())
    }
}

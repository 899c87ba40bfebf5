//! HuggingFace `tokenizer.json` files, read with `serde_json` and run without the
//! `tokenizers` crate.
//!
//! Supported (what GPT-2-, Llama-2- and BERT-style files and WordLevel files use):
//!
//! * models: `BPE` (merges by rank, `continuing_subword_prefix`, `end_of_word_suffix`,
//!   `byte_fallback`, `fuse_unk`, `ignore_merges`), `WordPiece`, `WordLevel`;
//! * normalizers: `Sequence`, `Lowercase`, `Prepend`, `Replace` (string patterns),
//!   `Strip`, `BertNormalizer` (clean_text, CJK padding, lowercase); `NFC`, `NFD`,
//!   `NFKC`, `NFKD` and `Precompiled` are taken as the identity (text is assumed already
//!   normalised) and accents are not stripped;
//! * pre-tokenizers: `Sequence`, `ByteLevel` (GPT-2's split, hand-written),
//!   `Whitespace`, `WhitespaceSplit`, `BertPreTokenizer`, `Metaspace`, `Digits`,
//!   `Punctuation`, `Split` with a string pattern;
//! * decoders: `Sequence`, `ByteLevel`, `Metaspace`, `WordPiece`, `BPEDecoder`,
//!   `Replace` (string), `ByteFallback`, `Fuse`, `Strip`;
//! * added tokens are matched in the raw text before normalisation.
//!
//! Regex patterns (`Split`/`Replace` with `{"Regex": ..}`, as Llama-3's file has) are
//! rejected with an error naming them, never silently approximated. Post-processors are
//! ignored: the dataset adds its own `[BOT]`/`[EOT]`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

use super::{config_err, Tokenizer};
use crate::Result;

type Map = serde_json::Map<String, Value>;

fn err(what: impl Into<String>) -> crate::DataError {
    config_err(format!("tokenizer.json: {}", what.into()))
}

fn obj<'a>(v: &'a Value, what: &str) -> Result<&'a Map> {
    v.as_object().ok_or_else(|| err(format!("{what} is not an object")))
}

fn kind<'a>(m: &'a Map, what: &str) -> Result<&'a str> {
    m.get("type").and_then(Value::as_str).ok_or_else(|| err(format!("{what} has no \"type\"")))
}

fn get_str<'a>(m: &'a Map, key: &str) -> Option<&'a str> {
    m.get(key).and_then(Value::as_str)
}

fn get_bool(m: &Map, key: &str, default: bool) -> bool {
    m.get(key).and_then(Value::as_bool).unwrap_or(default)
}

fn list<'a>(m: &'a Map, key: &str, what: &str) -> Result<&'a Vec<Value>> {
    m.get(key).and_then(Value::as_array).ok_or_else(|| err(format!("{what} has no list \"{key}\"")))
}

/// A `{"String": s}` pattern; a `{"Regex": r}` one is an error.
fn string_pattern(m: &Map, what: &str) -> Result<String> {
    let p = m.get("pattern").ok_or_else(|| err(format!("{what} has no \"pattern\"")))?;
    if let Some(s) = p.get("String").and_then(Value::as_str) {
        return Ok(s.to_string());
    }
    if let Some(s) = p.as_str() {
        return Ok(s.to_string());
    }
    if let Some(r) = p.get("Regex").and_then(Value::as_str) {
        return Err(err(format!("{what} with the regex pattern {r:?} is not supported")));
    }
    Err(err(format!("{what} has an unreadable pattern {p}")))
}

fn first_char(s: Option<&str>, default: char) -> char {
    s.and_then(|s| s.chars().next()).unwrap_or(default)
}

// ---------------------------------------------------------------------------------------
// GPT-2's byte <-> unicode alphabet
// ---------------------------------------------------------------------------------------

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the others to
/// code points from 256 on, in order.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        let c = if printable {
            u32::from(b)
        } else {
            n += 1;
            255 + n
        };
        table[usize::from(b)] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    table
}

// ---------------------------------------------------------------------------------------
// Normalizers
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Normalizer {
    Lowercase,
    Prepend(String),
    Replace(String, String),
    Strip { left: bool, right: bool },
    Bert { clean_text: bool, chinese: bool, lowercase: bool },
}

fn is_cjk(c: char) -> bool {
    matches!(u32::from(c),
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F | 0x2B820..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

impl Normalizer {
    fn parse(v: &Value, out: &mut Vec<Normalizer>) -> Result<()> {
        if v.is_null() {
            return Ok(());
        }
        let m = obj(v, "normalizer")?;
        match kind(m, "normalizer")? {
            "Sequence" => {
                for n in list(m, "normalizers", "Sequence normalizer")? {
                    Normalizer::parse(n, out)?;
                }
            }
            "Lowercase" => out.push(Normalizer::Lowercase),
            "Prepend" => out.push(Normalizer::Prepend(
                get_str(m, "prepend").ok_or_else(|| err("Prepend has no \"prepend\""))?.into(),
            )),
            "Replace" => {
                let content = get_str(m, "content").unwrap_or_default().to_string();
                out.push(Normalizer::Replace(string_pattern(m, "Replace normalizer")?, content))
            }
            "Strip" => out.push(Normalizer::Strip {
                left: get_bool(m, "strip_left", true),
                right: get_bool(m, "strip_right", true),
            }),
            "BertNormalizer" => out.push(Normalizer::Bert {
                clean_text: get_bool(m, "clean_text", true),
                chinese: get_bool(m, "handle_chinese_chars", true),
                lowercase: get_bool(m, "lowercase", true),
            }),
            "NFC" | "NFD" | "NFKC" | "NFKD" | "Precompiled" | "StripAccents" => {}
            other => return Err(err(format!("normalizer {other:?} is not supported"))),
        }
        Ok(())
    }

    fn apply(&self, s: String) -> String {
        match self {
            Normalizer::Lowercase => s.to_lowercase(),
            Normalizer::Prepend(p) if !s.is_empty() => format!("{p}{s}"),
            Normalizer::Prepend(_) => s,
            Normalizer::Replace(from, to) if !from.is_empty() => s.replace(from.as_str(), to),
            Normalizer::Replace(..) => s,
            Normalizer::Strip { left, right } => {
                let t = if *left { s.trim_start() } else { &s };
                let t = if *right { t.trim_end() } else { t };
                t.to_string()
            }
            Normalizer::Bert { clean_text, chinese, lowercase } => {
                let mut out = String::with_capacity(s.len());
                for c in s.chars() {
                    if *clean_text {
                        if c == '\0' || c == '\u{FFFD}' {
                            continue;
                        }
                        if c.is_whitespace() {
                            out.push(' ');
                            continue;
                        }
                        if c.is_control() {
                            continue;
                        }
                    }
                    if *chinese && is_cjk(c) {
                        out.push(' ');
                        out.push(c);
                        out.push(' ');
                    } else {
                        out.push(c);
                    }
                }
                if *lowercase {
                    out.to_lowercase()
                } else {
                    out
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrependScheme {
    Always,
    First,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SplitBehavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

#[derive(Clone, Debug)]
enum PreTokenizer {
    ByteLevel { add_prefix_space: bool, use_regex: bool },
    Whitespace,
    WhitespaceSplit,
    Bert,
    Metaspace { replacement: char, prepend: PrependScheme, split: bool },
    Digits { individual: bool },
    Punctuation,
    Split { pattern: String, behavior: SplitBehavior },
}

fn is_punct(c: char) -> bool {
    c.is_ascii_punctuation() || (!c.is_ascii() && !c.is_alphanumeric() && !c.is_whitespace())
}

/// Splits `s` into maximal runs by `class` (chars of class `None` are dropped).
fn runs(s: &str, class: impl Fn(char) -> Option<u8>) -> Vec<&str> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, u8)> = None;
    for (i, c) in s.char_indices() {
        let k = class(c);
        match (cur, k) {
            (Some((_, a)), Some(b)) if a == b => {}
            (Some((start, _)), _) => {
                out.push(&s[start..i]);
                cur = k.map(|k| (i, k));
            }
            (None, _) => cur = k.map(|k| (i, k)),
        }
    }
    if let Some((start, _)) = cur {
        out.push(&s[start..]);
    }
    out
}

/// Splits `s` at the pieces `is_delim` marks (ranges), placing them by `behavior`.
fn split_with(s: &str, delims: &[(usize, usize)], behavior: SplitBehavior) -> Vec<String> {
    let mut pieces: Vec<(String, bool)> = Vec::new();
    let mut last = 0;
    for &(a, b) in delims {
        if a > last {
            pieces.push((s[last..a].to_string(), false));
        }
        pieces.push((s[a..b].to_string(), true));
        last = b;
    }
    if last < s.len() {
        pieces.push((s[last..].to_string(), false));
    }
    let mut out: Vec<String> = Vec::new();
    match behavior {
        SplitBehavior::Removed => out.extend(pieces.into_iter().filter(|p| !p.1).map(|p| p.0)),
        SplitBehavior::Isolated => out.extend(pieces.into_iter().map(|p| p.0)),
        SplitBehavior::Contiguous => {
            let mut prev_delim = None;
            for (p, d) in pieces {
                match (out.last_mut(), prev_delim) {
                    (Some(last), Some(true)) if d => last.push_str(&p),
                    _ => out.push(p),
                }
                prev_delim = Some(d);
            }
        }
        SplitBehavior::MergedWithPrevious => {
            for (p, d) in pieces {
                match out.last_mut() {
                    Some(last) if d => last.push_str(&p),
                    _ => out.push(p),
                }
            }
        }
        SplitBehavior::MergedWithNext => {
            let mut pending = String::new();
            for (p, d) in pieces {
                if d {
                    if !pending.is_empty() {
                        out.push(std::mem::take(&mut pending));
                    }
                    pending = p;
                } else {
                    pending.push_str(&p);
                    out.push(std::mem::take(&mut pending));
                }
            }
            if !pending.is_empty() {
                out.push(pending);
            }
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// GPT-2's pre-tokenization regex, by hand:
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn gpt2_split(s: &str) -> Vec<&str> {
    let cs: Vec<(usize, char)> = s.char_indices().collect();
    let n = cs.len();
    let at = |i: usize| if i < n { cs[i].0 } else { s.len() };
    let class = |c: char| {
        if c.is_alphabetic() {
            0
        } else if c.is_numeric() {
            1
        } else {
            2
        }
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let c = cs[i].1;
        if c == '\'' {
            let next: String = cs[i + 1..n.min(i + 3)].iter().map(|x| x.1).collect();
            let len = if next.starts_with("re") || next.starts_with("ve") || next.starts_with("ll")
            {
                3
            } else if next.starts_with(['s', 't', 'm', 'd']) {
                2
            } else {
                0
            };
            if len > 0 {
                out.push(&s[at(i)..at(i + len)]);
                i += len;
                continue;
            }
        }
        let j = if c == ' ' && i + 1 < n && !cs[i + 1].1.is_whitespace() { i + 1 } else { i };
        let d = cs[j].1;
        if !d.is_whitespace() {
            let k0 = class(d);
            let mut k = j + 1;
            while k < n && !cs[k].1.is_whitespace() && class(cs[k].1) == k0 {
                k += 1;
            }
            out.push(&s[at(i)..at(k)]);
            i = k;
            continue;
        }
        let mut k = i;
        while k < n && cs[k].1.is_whitespace() {
            k += 1;
        }
        if k < n && k - i > 1 {
            k -= 1;
        }
        out.push(&s[at(i)..at(k)]);
        i = k;
    }
    out
}

impl PreTokenizer {
    fn parse(v: &Value, out: &mut Vec<PreTokenizer>) -> Result<()> {
        if v.is_null() {
            return Ok(());
        }
        let m = obj(v, "pre_tokenizer")?;
        match kind(m, "pre_tokenizer")? {
            "Sequence" => {
                for p in list(m, "pretokenizers", "Sequence pre_tokenizer")? {
                    PreTokenizer::parse(p, out)?;
                }
            }
            "ByteLevel" => out.push(PreTokenizer::ByteLevel {
                add_prefix_space: get_bool(m, "add_prefix_space", true),
                use_regex: get_bool(m, "use_regex", true),
            }),
            "Whitespace" => out.push(PreTokenizer::Whitespace),
            "WhitespaceSplit" => out.push(PreTokenizer::WhitespaceSplit),
            "BertPreTokenizer" => out.push(PreTokenizer::Bert),
            "Metaspace" => out.push(PreTokenizer::Metaspace {
                replacement: first_char(get_str(m, "replacement"), '\u{2581}'),
                prepend: parse_prepend(m)?,
                split: get_bool(m, "split", true),
            }),
            "Digits" => out
                .push(PreTokenizer::Digits { individual: get_bool(m, "individual_digits", false) }),
            "Punctuation" => out.push(PreTokenizer::Punctuation),
            "Split" => {
                if get_bool(m, "invert", false) {
                    return Err(err("Split pre_tokenizer with invert is not supported"));
                }
                let behavior = match get_str(m, "behavior").unwrap_or("Isolated") {
                    "Removed" => SplitBehavior::Removed,
                    "Isolated" => SplitBehavior::Isolated,
                    "MergedWithPrevious" => SplitBehavior::MergedWithPrevious,
                    "MergedWithNext" => SplitBehavior::MergedWithNext,
                    "Contiguous" => SplitBehavior::Contiguous,
                    b => return Err(err(format!("Split behavior {b:?} is not supported"))),
                };
                out.push(PreTokenizer::Split {
                    pattern: string_pattern(m, "Split pre_tokenizer")?,
                    behavior,
                })
            }
            other => return Err(err(format!("pre_tokenizer {other:?} is not supported"))),
        }
        Ok(())
    }

    /// Splits one piece; `first` is whether the piece starts the text (Metaspace's
    /// `prepend_scheme: "first"`).
    fn split(&self, s: String, first: bool, bytes: &[char; 256]) -> Vec<String> {
        match self {
            PreTokenizer::ByteLevel { add_prefix_space, use_regex } => {
                let s = if *add_prefix_space && !s.starts_with(char::is_whitespace) {
                    format!(" {s}")
                } else {
                    s
                };
                let map = |p: &str| p.bytes().map(|b| bytes[usize::from(b)]).collect::<String>();
                if *use_regex {
                    gpt2_split(&s).into_iter().map(map).collect()
                } else {
                    vec![map(&s)]
                }
            }
            PreTokenizer::Whitespace => runs(&s, |c| {
                if c.is_alphanumeric() || c == '_' {
                    Some(0)
                } else if c.is_whitespace() {
                    None
                } else {
                    Some(1)
                }
            })
            .into_iter()
            .map(str::to_string)
            .collect(),
            PreTokenizer::WhitespaceSplit => s.split_whitespace().map(str::to_string).collect(),
            PreTokenizer::Bert => {
                let mut out = Vec::new();
                for w in s.split_whitespace() {
                    let delims: Vec<(usize, usize)> = w
                        .char_indices()
                        .filter(|(_, c)| is_punct(*c))
                        .map(|(i, c)| (i, i + c.len_utf8()))
                        .collect();
                    out.extend(split_with(w, &delims, SplitBehavior::Isolated));
                }
                out
            }
            PreTokenizer::Metaspace { replacement, prepend, split } => {
                let mut t: String =
                    s.chars().map(|c| if c == ' ' { *replacement } else { c }).collect();
                let add = match prepend {
                    PrependScheme::Always => true,
                    PrependScheme::First => first,
                    PrependScheme::Never => false,
                };
                if add && !t.starts_with(*replacement) {
                    t.insert(0, *replacement);
                }
                if !*split {
                    return vec![t];
                }
                let delims: Vec<(usize, usize)> = t
                    .char_indices()
                    .filter(|(_, c)| c == replacement)
                    .map(|(i, c)| (i, i + c.len_utf8()))
                    .collect();
                split_with(&t, &delims, SplitBehavior::MergedWithNext)
            }
            PreTokenizer::Digits { individual } => {
                let delims: Vec<(usize, usize)> = if *individual {
                    s.char_indices()
                        .filter(|(_, c)| c.is_ascii_digit())
                        .map(|(i, _)| (i, i + 1))
                        .collect()
                } else {
                    let mut d = Vec::new();
                    let mut start = None;
                    for (i, c) in s.char_indices() {
                        match (c.is_ascii_digit(), start) {
                            (true, None) => start = Some(i),
                            (false, Some(a)) => {
                                d.push((a, i));
                                start = None;
                            }
                            _ => {}
                        }
                    }
                    if let Some(a) = start {
                        d.push((a, s.len()));
                    }
                    d
                };
                split_with(&s, &delims, SplitBehavior::Isolated)
            }
            PreTokenizer::Punctuation => {
                let delims: Vec<(usize, usize)> = s
                    .char_indices()
                    .filter(|(_, c)| is_punct(*c))
                    .map(|(i, c)| (i, i + c.len_utf8()))
                    .collect();
                split_with(&s, &delims, SplitBehavior::Isolated)
            }
            PreTokenizer::Split { pattern, behavior } => {
                if pattern.is_empty() {
                    return vec![s];
                }
                let delims: Vec<(usize, usize)> =
                    s.match_indices(pattern.as_str()).map(|(i, p)| (i, i + p.len())).collect();
                split_with(&s, &delims, *behavior)
            }
        }
    }
}

fn parse_prepend(m: &Map) -> Result<PrependScheme> {
    if let Some(s) = get_str(m, "prepend_scheme") {
        return match s {
            "always" => Ok(PrependScheme::Always),
            "first" => Ok(PrependScheme::First),
            "never" => Ok(PrependScheme::Never),
            o => Err(err(format!("Metaspace prepend_scheme {o:?} is not supported"))),
        };
    }
    Ok(if get_bool(m, "add_prefix_space", true) {
        PrependScheme::Always
    } else {
        PrependScheme::Never
    })
}

// ---------------------------------------------------------------------------------------
// Models
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Bpe {
    merges: HashMap<(u32, u32), (usize, u32)>,
    unk: Option<u32>,
    prefix: Option<String>,
    suffix: Option<String>,
    byte_fallback: bool,
    fuse_unk: bool,
    ignore_merges: bool,
}

#[derive(Clone, Debug)]
enum Model {
    WordLevel { unk: Option<u32> },
    WordPiece { unk: Option<u32>, prefix: String, max_chars: usize },
    Bpe(Bpe),
}

fn read_vocab(m: &Map) -> Result<HashMap<String, u32>> {
    let v = m.get("vocab").ok_or_else(|| err("model has no \"vocab\""))?;
    let mut vocab = HashMap::new();
    match v {
        Value::Object(o) => {
            for (k, id) in o {
                let id = id
                    .as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| err(format!("vocab entry {k:?} has id {id}")))?;
                vocab.insert(k.clone(), id);
            }
        }
        _ => return Err(err("model vocab is not an object of token -> id")),
    }
    Ok(vocab)
}

impl Model {
    fn parse(v: &Value, vocab: &HashMap<String, u32>) -> Result<Model> {
        let m = obj(v, "model")?;
        let unk = get_str(m, "unk_token").and_then(|u| vocab.get(u).copied());
        let ty = match get_str(m, "type") {
            Some(t) => t,
            None if m.contains_key("merges") => "BPE",
            None if m.contains_key("max_input_chars_per_word") => "WordPiece",
            None => "WordLevel",
        };
        Ok(match ty {
            "WordLevel" => Model::WordLevel { unk },
            "WordPiece" => Model::WordPiece {
                unk,
                prefix: get_str(m, "continuing_subword_prefix").unwrap_or("##").to_string(),
                max_chars: m
                    .get("max_input_chars_per_word")
                    .and_then(Value::as_u64)
                    .map_or(100, |x| x as usize),
            },
            "BPE" => {
                let prefix = get_str(m, "continuing_subword_prefix").map(str::to_string);
                let mut merges = HashMap::new();
                let empty = Vec::new();
                let raw = m.get("merges").and_then(Value::as_array).unwrap_or(&empty);
                for (rank, mv) in raw.iter().enumerate() {
                    let (a, b) = match mv {
                        Value::String(s) => s
                            .split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                            .ok_or_else(|| err(format!("merge {s:?} is not \"a b\"")))?,
                        Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                            (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                            _ => return Err(err(format!("merge {mv} is not two strings"))),
                        },
                        _ => return Err(err(format!("merge {mv} is not readable"))),
                    };
                    let tail = match &prefix {
                        Some(p) => b.strip_prefix(p.as_str()).unwrap_or(&b),
                        None => &b,
                    };
                    let merged = format!("{a}{tail}");
                    let id = |t: &str| {
                        vocab.get(t).copied().ok_or_else(|| {
                            err(format!("merge {a:?} {b:?}: token {t:?} is not in the vocab"))
                        })
                    };
                    merges.entry((id(&a)?, id(&b)?)).or_insert((rank, id(&merged)?));
                }
                Model::Bpe(Bpe {
                    merges,
                    unk,
                    prefix,
                    suffix: get_str(m, "end_of_word_suffix").map(str::to_string),
                    byte_fallback: get_bool(m, "byte_fallback", false),
                    fuse_unk: get_bool(m, "fuse_unk", false),
                    ignore_merges: get_bool(m, "ignore_merges", false),
                })
            }
            other => return Err(err(format!("model {other:?} is not supported"))),
        })
    }

    fn tokenize(&self, w: &str, vocab: &HashMap<String, u32>, out: &mut Vec<u32>) {
        if w.is_empty() {
            return;
        }
        match self {
            Model::WordLevel { unk } => {
                if let Some(id) = vocab.get(w).copied().or(*unk) {
                    out.push(id);
                }
            }
            Model::WordPiece { unk, prefix, max_chars } => {
                let chars: Vec<(usize, char)> = w.char_indices().collect();
                if chars.len() > *max_chars {
                    out.extend(unk);
                    return;
                }
                let mut ids = Vec::new();
                let mut start = 0;
                while start < chars.len() {
                    let mut end = chars.len();
                    let mut found = None;
                    while end > start {
                        let a = chars[start].0;
                        let b = if end < chars.len() { chars[end].0 } else { w.len() };
                        let piece = if start > 0 {
                            format!("{prefix}{}", &w[a..b])
                        } else {
                            w[a..b].to_string()
                        };
                        if let Some(&id) = vocab.get(&piece) {
                            found = Some(id);
                            break;
                        }
                        end -= 1;
                    }
                    match found {
                        Some(id) => {
                            ids.push(id);
                            start = end;
                        }
                        None => {
                            out.extend(unk);
                            return;
                        }
                    }
                }
                out.extend(ids);
            }
            Model::Bpe(bpe) => bpe.tokenize(w, vocab, out),
        }
    }
}

impl Bpe {
    fn tokenize(&self, w: &str, vocab: &HashMap<String, u32>, out: &mut Vec<u32>) {
        if self.ignore_merges {
            if let Some(&id) = vocab.get(w) {
                out.push(id);
                return;
            }
        }
        let n = w.chars().count();
        let mut syms: Vec<u32> = Vec::with_capacity(n);
        let mut last_unk = false;
        for (i, c) in w.chars().enumerate() {
            let mut s = String::new();
            if i > 0 {
                if let Some(p) = &self.prefix {
                    s.push_str(p);
                }
            }
            s.push(c);
            if i + 1 == n {
                if let Some(x) = &self.suffix {
                    s.push_str(x);
                }
            }
            if let Some(&id) = vocab.get(&s) {
                syms.push(id);
                last_unk = false;
                continue;
            }
            if self.byte_fallback {
                let mut buf = [0u8; 4];
                let ids: Option<Vec<u32>> = c
                    .encode_utf8(&mut buf)
                    .bytes()
                    .map(|b| vocab.get(&format!("<0x{b:02X}>")).copied())
                    .collect();
                if let Some(ids) = ids {
                    syms.extend(ids);
                    last_unk = false;
                    continue;
                }
            }
            if let Some(u) = self.unk {
                if !(self.fuse_unk && last_unk) {
                    syms.push(u);
                }
                last_unk = true;
            }
        }
        out.extend(self.merge(syms));
    }

    /// Applies merges lowest rank first (leftmost among equals), as HF's BPE: a heap of
    /// candidate pairs over a linked list of symbols, O(n log n) even for a whole
    /// document without pre-tokenization.
    fn merge(&self, mut ids: Vec<u32>) -> Vec<u32> {
        const NONE: usize = usize::MAX;
        let n = ids.len();
        if n < 2 {
            return ids;
        }
        let mut next: Vec<usize> = (1..=n).map(|i| if i < n { i } else { NONE }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        for i in 0..n - 1 {
            if let Some(&(rank, _)) = self.merges.get(&(ids[i], ids[i + 1])) {
                heap.push(Reverse((rank, i)));
            }
        }
        while let Some(Reverse((rank, i))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j == NONE {
                continue;
            }
            let Some(&(r, new_id)) = self.merges.get(&(ids[i], ids[j])) else { continue };
            if r != rank {
                continue;
            }
            ids[i] = new_id;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                if let Some(&(r, _)) = self.merges.get(&(ids[prev[i]], ids[i])) {
                    heap.push(Reverse((r, prev[i])));
                }
            }
            if next[i] != NONE {
                if let Some(&(r, _)) = self.merges.get(&(ids[i], ids[next[i]])) {
                    heap.push(Reverse((r, i)));
                }
            }
        }
        ids.into_iter().zip(alive).filter(|x| x.1).map(|x| x.0).collect()
    }
}

// ---------------------------------------------------------------------------------------
// Decoders
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Decoder {
    ByteLevel,
    Metaspace { replacement: char, prepend: PrependScheme },
    WordPiece { prefix: String, cleanup: bool },
    Bpe { suffix: String },
    Replace(String, String),
    ByteFallback,
    Fuse,
    Strip { content: char, start: usize, stop: usize },
}

fn parse_byte_token(t: &str) -> Option<u8> {
    let h = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if h.len() != 2 {
        return None;
    }
    u8::from_str_radix(h, 16).ok()
}

fn cleanup(s: &str) -> String {
    let mut s = s.to_string();
    for (a, b) in [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ] {
        s = s.replace(a, b);
    }
    s
}

impl Decoder {
    fn parse(v: &Value, out: &mut Vec<Decoder>) -> Result<()> {
        if v.is_null() {
            return Ok(());
        }
        let m = obj(v, "decoder")?;
        match kind(m, "decoder")? {
            "Sequence" => {
                for d in list(m, "decoders", "Sequence decoder")? {
                    Decoder::parse(d, out)?;
                }
            }
            "ByteLevel" => out.push(Decoder::ByteLevel),
            "Metaspace" => out.push(Decoder::Metaspace {
                replacement: first_char(get_str(m, "replacement"), '\u{2581}'),
                prepend: parse_prepend(m)?,
            }),
            "WordPiece" => out.push(Decoder::WordPiece {
                prefix: get_str(m, "prefix").unwrap_or("##").to_string(),
                cleanup: get_bool(m, "cleanup", true),
            }),
            "BPEDecoder" => out
                .push(Decoder::Bpe { suffix: get_str(m, "suffix").unwrap_or("</w>").to_string() }),
            "Replace" => {
                let content = get_str(m, "content").unwrap_or_default().to_string();
                out.push(Decoder::Replace(string_pattern(m, "Replace decoder")?, content))
            }
            "ByteFallback" => out.push(Decoder::ByteFallback),
            "Fuse" => out.push(Decoder::Fuse),
            "Strip" => out.push(Decoder::Strip {
                content: first_char(get_str(m, "content"), ' '),
                start: m.get("start").and_then(Value::as_u64).unwrap_or(0) as usize,
                stop: m.get("stop").and_then(Value::as_u64).unwrap_or(0) as usize,
            }),
            other => return Err(err(format!("decoder {other:?} is not supported"))),
        }
        Ok(())
    }

    fn decode_chain(&self, tokens: Vec<String>, chars: &HashMap<char, u8>) -> Vec<String> {
        match self {
            Decoder::ByteLevel => {
                let bytes: Vec<u8> = tokens
                    .iter()
                    .flat_map(|t| t.chars())
                    .flat_map(|c| match chars.get(&c) {
                        Some(&b) => vec![b],
                        None => c.to_string().into_bytes(),
                    })
                    .collect();
                vec![String::from_utf8_lossy(&bytes).into_owned()]
            }
            Decoder::Metaspace { replacement, prepend } => tokens
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let t: String =
                        t.chars().map(|c| if c == *replacement { ' ' } else { c }).collect();
                    if i == 0 && *prepend != PrependScheme::Never {
                        t.strip_prefix(' ').map(str::to_string).unwrap_or(t)
                    } else {
                        t
                    }
                })
                .collect(),
            Decoder::WordPiece { prefix, cleanup: clean } => tokens
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let t = if i == 0 {
                        t
                    } else if let Some(rest) = t.strip_prefix(prefix.as_str()) {
                        rest.to_string()
                    } else {
                        format!(" {t}")
                    };
                    if *clean {
                        cleanup(&t)
                    } else {
                        t
                    }
                })
                .collect(),
            Decoder::Bpe { suffix } => {
                let n = tokens.len();
                tokens
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| t.replace(suffix.as_str(), if i + 1 == n { "" } else { " " }))
                    .collect()
            }
            Decoder::Replace(from, to) if !from.is_empty() => {
                tokens.into_iter().map(|t| t.replace(from.as_str(), to)).collect()
            }
            Decoder::Replace(..) => tokens,
            Decoder::ByteFallback => {
                let mut out = Vec::new();
                let mut pending: Vec<u8> = Vec::new();
                for t in tokens {
                    match parse_byte_token(&t) {
                        Some(b) => pending.push(b),
                        None => {
                            if !pending.is_empty() {
                                out.push(String::from_utf8_lossy(&pending).into_owned());
                                pending.clear();
                            }
                            out.push(t);
                        }
                    }
                }
                if !pending.is_empty() {
                    out.push(String::from_utf8_lossy(&pending).into_owned());
                }
                out
            }
            Decoder::Fuse => vec![tokens.concat()],
            Decoder::Strip { content, start, stop } => tokens
                .into_iter()
                .map(|t| {
                    let cs: Vec<char> = t.chars().collect();
                    let a = cs.iter().take(*start).take_while(|&&c| c == *content).count();
                    let b =
                        cs[a..].iter().rev().take(*stop).take_while(|&&c| c == *content).count();
                    cs[a..cs.len() - b].iter().collect()
                })
                .collect(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The tokenizer
// ---------------------------------------------------------------------------------------

/// A tokenizer read from a HuggingFace `tokenizer.json` (see the module docs for what is
/// supported; anything else is an error at load time, not a silent approximation).
///
/// The three specials are looked up by name among the added tokens and the vocabulary:
/// `[BOT]`, `<|begin_of_text|>`, `<s>`, `<bos>`, `[CLS]`, `<|endoftext|>` for BOT;
/// `[EOT]`, `<|end_of_text|>`, `</s>`, `<eos>`, `[SEP]`, `<|endoftext|>` for EOT;
/// `[PAD]`, `<pad>`, `<|pad|>` for PAD. One that is missing gets a new id past the
/// vocabulary (so [`Tokenizer::vocab_size`] grows by one), named `[BOT]`/`[EOT]`/`[PAD]`.
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    vocab: HashMap<String, u32>,
    id_to_token: HashMap<u32, String>,
    model: Model,
    normalizers: Vec<Normalizer>,
    pre_tokenizers: Vec<PreTokenizer>,
    decoders: Vec<Decoder>,
    /// Added tokens (content, id), longest first, for matching in raw text.
    added: Vec<(String, u32)>,
    specials: HashSet<u32>,
    bytes: [char; 256],
    chars: HashMap<char, u8>,
    bot: u32,
    eot: u32,
    pad: u32,
    vocab_size: usize,
}

impl HfTokenizer {
    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<HfTokenizer> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| config_err(format!("cannot read tokenizer {}: {e}", path.display())))?;
        HfTokenizer::from_json_str(&text)
            .map_err(|e| config_err(format!("{}: {e}", path.display())))
    }

    /// Parses the contents of a `tokenizer.json` file.
    pub fn from_json_str(json: &str) -> Result<HfTokenizer> {
        let root: Value =
            serde_json::from_str(json).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let root = obj(&root, "the file")?;
        let model_v = root.get("model").ok_or_else(|| err("no \"model\""))?;
        let mut vocab = read_vocab(obj(model_v, "model")?)?;
        let model = Model::parse(model_v, &vocab)?;
        let mut normalizers = Vec::new();
        Normalizer::parse(root.get("normalizer").unwrap_or(&Value::Null), &mut normalizers)?;
        let mut pre_tokenizers = Vec::new();
        PreTokenizer::parse(
            root.get("pre_tokenizer").unwrap_or(&Value::Null),
            &mut pre_tokenizers,
        )?;
        let mut decoders = Vec::new();
        Decoder::parse(root.get("decoder").unwrap_or(&Value::Null), &mut decoders)?;

        let mut added = Vec::new();
        let mut specials = HashSet::new();
        if let Some(list) = root.get("added_tokens").and_then(Value::as_array) {
            for t in list {
                let t = obj(t, "added token")?;
                let content =
                    get_str(t, "content").ok_or_else(|| err("added token has no content"))?;
                let id = t
                    .get("id")
                    .and_then(Value::as_u64)
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| err(format!("added token {content:?} has no valid id")))?;
                if get_bool(t, "special", false) {
                    specials.insert(id);
                }
                vocab.insert(content.to_string(), id);
                if !content.is_empty() {
                    added.push((content.to_string(), id));
                }
            }
        }
        added.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut id_to_token: HashMap<u32, String> =
            vocab.iter().map(|(k, &v)| (v, k.clone())).collect();
        let mut vocab_size = id_to_token.keys().max().map_or(0, |&m| m as usize + 1);

        let mut special = |names: &[&str], fallback: &str| -> u32 {
            let found = names.iter().find_map(|n| vocab.get(*n).copied());
            let id = found.unwrap_or_else(|| {
                let id = vocab_size as u32;
                vocab_size += 1;
                id_to_token.insert(id, fallback.to_string());
                id
            });
            specials.insert(id);
            id
        };
        let bot = special(
            &["[BOT]", "<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|endoftext|>"],
            "[BOT]",
        );
        let eot = special(
            &["[EOT]", "<|end_of_text|>", "</s>", "<eos>", "[SEP]", "<|endoftext|>"],
            "[EOT]",
        );
        let pad = special(&["[PAD]", "<pad>", "<|pad|>"], "[PAD]");

        let bytes = byte_to_char_table();
        let chars = bytes.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        Ok(HfTokenizer {
            vocab,
            id_to_token,
            model,
            normalizers,
            pre_tokenizers,
            decoders,
            added,
            specials,
            bytes,
            chars,
            bot,
            eot,
            pad,
            vocab_size,
        })
    }

    /// The id of a token string (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.id_to_token.get(&id).map(String::as_str)
    }

    fn encode_segment(&self, text: &str, first: bool, out: &mut Vec<u32>) {
        let mut s = text.to_string();
        for n in &self.normalizers {
            s = n.apply(s);
        }
        let mut pieces = vec![s];
        for p in &self.pre_tokenizers {
            pieces = pieces
                .into_iter()
                .enumerate()
                .flat_map(|(i, piece)| p.split(piece, first && i == 0, &self.bytes))
                .collect();
        }
        for piece in &pieces {
            self.model.tokenize(piece, &self.vocab, out);
        }
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        let mut first = true;
        while !rest.is_empty() {
            // The earliest added token in `rest` (longest first at one position).
            let hit = self
                .added
                .iter()
                .filter_map(|(c, id)| rest.find(c.as_str()).map(|at| (at, c.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            match hit {
                Some((at, len, id)) => {
                    if at > 0 {
                        self.encode_segment(&rest[..at], first, &mut out);
                    }
                    out.push(id);
                    rest = &rest[at + len..];
                }
                None => {
                    self.encode_segment(rest, first, &mut out);
                    rest = "";
                }
            }
            first = false;
        }
        out
    }

    fn decode(&self, ids: &[u32]) -> String {
        let tokens: Vec<String> = ids
            .iter()
            .filter(|id| !self.specials.contains(id))
            .filter_map(|id| self.id_to_token.get(id).cloned())
            .collect();
        if self.decoders.is_empty() {
            return tokens.join(" ");
        }
        let mut tokens = tokens;
        for d in &self.decoders {
            tokens = d.decode_chain(tokens, &self.chars);
        }
        tokens.concat()
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn bot_id(&self) -> u32 {
        self.bot
    }

    fn eot_id(&self) -> u32 {
        self.eot
    }

    fn pad_id(&self) -> u32 {
        self.pad
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{gpt2_split, Bpe};

    /// The heap-based merge equals the naive "apply the lowest-ranked, leftmost pair"
    /// loop on sequences with overlapping and repeated pairs.
    #[test]
    fn bpe_heap_merge_equals_the_naive_loop() {
        // ids 0..3 are a, b, c; merges (rank: pair -> new id).
        let table = [((0, 0), 3), ((3, 3), 4), ((0, 1), 5), ((5, 2), 6), ((1, 2), 7), ((4, 0), 8)];
        let merges: HashMap<(u32, u32), (usize, u32)> =
            table.iter().enumerate().map(|(r, &(p, id))| (p, (r, id))).collect();
        let bpe = Bpe {
            merges: merges.clone(),
            unk: None,
            prefix: None,
            suffix: None,
            byte_fallback: false,
            fuse_unk: false,
            ignore_merges: false,
        };
        let naive = |mut syms: Vec<u32>| {
            loop {
                let best = syms
                    .windows(2)
                    .enumerate()
                    .filter_map(|(i, p)| merges.get(&(p[0], p[1])).map(|&(r, id)| (r, i, id)))
                    .min();
                let Some((_, i, id)) = best else { break };
                syms[i] = id;
                syms.remove(i + 1);
            }
            syms
        };
        let mut x = 12345u64;
        for len in 0..40 {
            for _ in 0..20 {
                let seq: Vec<u32> = (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((x >> 33) % 3) as u32
                    })
                    .collect();
                assert_eq!(bpe.merge(seq.clone()), naive(seq.clone()), "{seq:?}");
            }
        }
    }

    /// Expected splits computed with Python's `regex` module and GPT-2's pattern.
    #[test]
    fn gpt2_split_matches_the_regex() {
        let cases: &[(&str, &[&str])] = &[
            ("hello world", &["hello", " world"]),
            ("  hello   world  ", &[" ", " hello", "  ", " world", "  "]),
            ("\n\nword", &["\n", "\n", "word"]),
            ("it's 2024, isn't it?", &["it", "'s", " 2024", ",", " isn", "'t", " it", "?"]),
            ("a\tb", &["a", "\t", "b"]),
            ("x  ", &["x", "  "]),
            ("  ", &["  "]),
            ("Grüße 日本語 123abc", &["Grüße", " 日本語", " 123", "abc"]),
            ("he'll 'ok' ''", &["he", "'ll", " '", "ok", "'", " ''"]),
            (" !!! ?", &[" !!!", " ?"]),
            ("a \n b", &["a", " \n", " b"]),
            ("tab\t\tx", &["tab", "\t", "\t", "x"]),
        ];
        for (text, want) in cases {
            assert_eq!(gpt2_split(text), *want, "{text:?}");
        }
    }
}

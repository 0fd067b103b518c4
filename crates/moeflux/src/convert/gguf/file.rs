//! The GGUF container (v2/v3, little-endian): header, metadata key/values,
//! tensor infos, aligned data.
//!
//! Hand-written rather than a crate: the format is ~100 lines of parsing,
//! and the crates that read it (`gguf`, `gguf-rs`) read into owned buffers
//! through `Read` without bounding counts by the file size, or pull in a
//! framework. Here every count, length, shape and offset is checked against
//! the bytes that remain before anything is allocated or sliced, and each
//! error names the file (and tensor or key).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

use super::ggml::GgmlType;

pub const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// Array entries in all of a file's metadata (vocabularies and merges are
/// below 2M): bounds memory, since a 1-byte entry becomes one `Value`.
const MAX_ARRAY_ITEMS: u64 = 1 << 24;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U(u64),
    I(i64),
    F(f64),
    Bool(bool),
    Str(String),
    Arr(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U(v) => Some(v),
            Value::I(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F(v) => Some(v),
            Value::U(v) => Some(v as f64),
            Value::I(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_arr(&self) -> Option<&[Value]> {
        match self {
            Value::Arr(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's info; `dims` as ggml orders them (`dims[0]` varies fastest).
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Row-major shape (outermost first), as safetensors orders it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed GGUF header.
#[derive(Debug)]
pub struct Parsed {
    pub version: u32,
    pub kv: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
    items: u64,
}

impl<'a> Reader<'a> {
    fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::format(self.path, format!("GGUF: {what} (at byte {})", self.pos))
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.b.len() - self.pos) as u64;
        if n > left {
            return Err(self.err(format!(
                "{what}: needs {n} bytes, only {left} left (truncated or corrupt)"
            )));
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U(self.arr::<1>(key)?[0] as u64),
            1 => Value::I(self.arr::<1>(key)?[0] as i8 as i64),
            2 => Value::U(u16::from_le_bytes(self.arr(key)?) as u64),
            3 => Value::I(i16::from_le_bytes(self.arr(key)?) as i64),
            4 => Value::U(self.u32(key)? as u64),
            5 => Value::I(i32::from_le_bytes(self.arr(key)?) as i64),
            6 => Value::F(f32::from_le_bytes(self.arr(key)?) as f64),
            7 => match self.arr::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("`{key}`: bool byte {b}"))),
            },
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(self.err(format!("`{key}`: arrays nested deeper than one level")));
                }
                let ety = self.u32(key)?;
                let n = self.u64(key)?;
                // Every entry takes at least one byte: a count beyond the
                // bytes left is corrupt, caught before allocating.
                let left = (self.b.len() - self.pos) as u64;
                self.items = self.items.saturating_add(n);
                if n > left || self.items > MAX_ARRAY_ITEMS {
                    return Err(self.err(format!(
                        "`{key}`: array of {n} entries ({left} bytes left, at most \
                         {MAX_ARRAY_ITEMS} entries in all)"
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Arr(v)
            }
            10 => Value::U(self.u64(key)?),
            11 => Value::I(i64::from_le_bytes(self.arr(key)?)),
            12 => Value::F(f64::from_le_bytes(self.arr(key)?)),
            t => return Err(self.err(format!("`{key}`: unknown value type {t}"))),
        })
    }
}

/// Magic and version; returns (version, tensor count, metadata count).
fn header(r: &mut Reader) -> Result<(u32, u64, u64)> {
    if r.take(4, "magic")? != MAGIC {
        return Err(Error::format(r.path, "not a GGUF file (no `GGUF` magic)"));
    }
    let version = r.u32("version")?;
    if !matches!(version, 2 | 3) {
        return Err(Error::format(
            r.path,
            format!("GGUF version {version}; versions 2 and 3 are supported"),
        ));
    }
    Ok((version, r.u64("tensor count")?, r.u64("metadata count")?))
}

/// `general.architecture` from the first bytes of a GGUF file (a download's
/// first range). Writers put it first, so a few KiB suffice. The header
/// must be sound; a key or value the prefix cuts (or garbles: [`parse`]
/// of the whole file reports that) gives `None`, not known.
pub fn architecture_in_prefix(b: &[u8], path: &Path) -> Result<Option<String>> {
    let mut r = Reader {
        b,
        pos: 0,
        path,
        items: 0,
    };
    let (_, _, n_kv) = header(&mut r)?;
    for _ in 0..n_kv {
        let Ok(key) = r.string("metadata key") else {
            return Ok(None);
        };
        let Ok(v) = r.u32(&key).and_then(|ty| r.value(ty, &key, 0)) else {
            return Ok(None);
        };
        if key == "general.architecture" {
            return match v {
                Value::Str(s) => Ok(Some(s)),
                _ => Err(Error::format(
                    path,
                    "GGUF: `general.architecture` is not a string",
                )),
            };
        }
    }
    Ok(None)
}

/// Parses a whole GGUF file held in `b` (`path` for messages).
pub fn parse(b: &[u8], path: &Path) -> Result<Parsed> {
    let mut r = Reader {
        b,
        pos: 0,
        path,
        items: 0,
    };
    let (version, n_tensors, n_kv) = header(&mut r)?;
    // A key/value takes at least 12 bytes, a tensor info at least 24.
    let left = (b.len() - r.pos) as u64;
    if n_kv > left / 12 || n_tensors > left / 24 {
        return Err(r.err(format!(
            "{n_kv} metadata entries and {n_tensors} tensors cannot fit in {left} bytes"
        )));
    }
    let mut kv = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let ty = r.u32(&key)?;
        let v = r.value(ty, &key, 0)?;
        if kv.insert(key.clone(), v).is_some() {
            return Err(r.err(format!("metadata key `{key}` appears twice")));
        }
    }
    let alignment = match kv.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(Error::format(
                    path,
                    format!("GGUF: general.alignment {v:?} is not a power of two up to 1 MiB"),
                ))
            }
        },
    };
    let mut infos = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let nd = r.u32(&name)? as usize;
        if nd == 0 || nd > MAX_DIMS {
            return Err(Error::tensor(
                path,
                &name,
                format!("{nd} dimensions (1 to {MAX_DIMS})"),
            ));
        }
        let mut dims = Vec::with_capacity(nd);
        for _ in 0..nd {
            dims.push(r.u64(&name)?);
        }
        let ty_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        infos.push((name, dims, ty_id, offset));
    }
    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let data_len = (b.len() as u64).saturating_sub(data_start);
    let mut tensors = Vec::with_capacity(infos.len());
    let mut seen = std::collections::BTreeSet::new();
    for (name, dims, ty_id, offset) in infos {
        let terr = |reason: String| Error::tensor(path, &name, reason);
        if !seen.insert(name.clone()) {
            return Err(terr("tensor listed twice".into()));
        }
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| terr(format!("unknown ggml type id {ty_id}")))?;
        let elems = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n > 0)
            .ok_or_else(|| terr(format!("dimensions {dims:?} are empty or overflow")))?;
        if dims[0] % ty.block as u64 != 0 {
            return Err(terr(format!(
                "{} rows of {} values: not whole {}-value blocks",
                ty.name, dims[0], ty.block
            )));
        }
        let bytes = (elems / ty.block as u64)
            .checked_mul(ty.bytes as u64)
            .ok_or_else(|| terr(format!("dimensions {dims:?} overflow")))?;
        if offset % alignment != 0 {
            return Err(terr(format!(
                "data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        match offset.checked_add(bytes) {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(terr(format!(
                    "{bytes} bytes at data offset {offset} run past the file's {data_len} \
                     data bytes (truncated?)"
                )))
            }
        }
        let dims: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            start: (data_start + offset) as usize,
            len: bytes as usize,
        });
    }
    Ok(Parsed {
        version,
        kv,
        tensors,
    })
}

/// The parts of a split GGUF (`NAME-00001-of-0000N.gguf`), given any one
/// of them; `[path]` for a file that is not named as a part.
pub fn split_parts(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let Some(stem) = name.strip_suffix(".gguf") else {
        return Ok(vec![path.to_path_buf()]);
    };
    // "<prefix>-NNNNN-of-MMMMM"
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    let (n, of, total, prefix) = match parts.as_slice() {
        [total, of, n, prefix] => (n, *of, total, prefix),
        _ => return Ok(vec![path.to_path_buf()]),
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|c| c.is_ascii_digit());
    if of != "of" || !digits(n) || !digits(total) {
        return Ok(vec![path.to_path_buf()]);
    }
    let count: usize = total.parse().expect("digits");
    if count == 0 {
        return Err(Error::format(path, "split GGUF of 0 parts"));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    Ok((1..=count)
        .map(|i| dir.join(format!("{prefix}-{i:05}-of-{count:05}.gguf")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        let p = Path::new("/m/x-Q4_K_M-00002-of-00003.gguf");
        let v = split_parts(p).unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v[0], Path::new("/m/x-Q4_K_M-00001-of-00003.gguf"));
        assert_eq!(split_parts(Path::new("/m/a.gguf")).unwrap().len(), 1);
        assert_eq!(
            split_parts(Path::new("/m/a-1-of-2.gguf")).unwrap(),
            vec![PathBuf::from("/m/a-1-of-2.gguf")]
        );
    }

    #[test]
    fn architecture_from_a_prefix() {
        let p = Path::new("t.gguf");
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(5u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        for (k, v) in [("general.name", "m"), ("general.architecture", "qwen3moe")] {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(8u32.to_le_bytes());
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.as_bytes());
        }
        assert_eq!(
            architecture_in_prefix(&b, p).unwrap().as_deref(),
            Some("qwen3moe")
        );
        // Cut anywhere after the header: not known yet, never an error.
        for cut in 24..b.len() {
            assert_eq!(architecture_in_prefix(&b[..cut], p).unwrap(), None, "{cut}");
        }
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(architecture_in_prefix(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("not a GGUF file"));
        let mut v1 = b.clone();
        v1[4] = 1;
        assert!(architecture_in_prefix(&v1, p).is_err());
    }

    #[test]
    fn hostile_headers_are_errors() {
        let p = Path::new("t.gguf");
        let mut h = b"GGUF".to_vec();
        h.extend(3u32.to_le_bytes());
        h.extend(u64::MAX.to_le_bytes());
        h.extend(0u64.to_le_bytes());
        assert!(parse(&h, p).unwrap_err().to_string().contains("cannot fit"));
        // An array count far beyond the file.
        let mut h = b"GGUF".to_vec();
        h.extend(3u32.to_le_bytes());
        h.extend(0u64.to_le_bytes());
        h.extend(1u64.to_le_bytes());
        h.extend(1u64.to_le_bytes());
        h.push(b'k');
        h.extend(9u32.to_le_bytes());
        h.extend(8u32.to_le_bytes());
        h.extend((1u64 << 40).to_le_bytes());
        h.extend([0u8; 16]);
        let e = parse(&h, p).unwrap_err().to_string();
        assert!(e.contains("array of") && e.contains("t.gguf"), "{e}");
        assert!(parse(b"GGUF", p).is_err());
        // A tensor whose byte size overflows u64.
        let mut h = b"GGUF".to_vec();
        h.extend(3u32.to_le_bytes());
        h.extend(1u64.to_le_bytes());
        h.extend(0u64.to_le_bytes());
        h.extend(1u64.to_le_bytes());
        h.push(b't');
        h.extend(2u32.to_le_bytes());
        h.extend(32u64.to_le_bytes());
        h.extend((1u64 << 58).to_le_bytes());
        h.extend(0u32.to_le_bytes());
        h.extend(0u64.to_le_bytes());
        h.extend([0u8; 64]);
        let e = parse(&h, p).unwrap_err().to_string();
        assert!(e.contains("`t`") && e.contains("overflow"), "{e}");
        assert!(parse(b"GGML0000", p).is_err());
    }
}

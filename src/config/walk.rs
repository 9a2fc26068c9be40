//! Walking a parsed `proxy.toml` with positions, for `load.rs`: a [`Cx`] collects every
//! problem at its `FILE:LINE:COL: field.path`, a [`Node`] is one value with its path and span,
//! a [`TableReader`] hands out one table's fields and then reports the keys nobody asked for.
//! Nothing here knows tollgate's sections (`load.rs`) or the syntax of values (`syntax.rs`).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml_edit::{Item, Table, TableLike, Value};

use super::syntax::{check_name, expand, parse_socket_addr, positive_duration, positive_size};
use super::{ConfigError, ConfigErrors};

/// The environment lookup the caller provides (`std::env::var(..).ok()` in `main`).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A byte range in the source text, when toml_edit knows one.
pub type Span = Option<Range<usize>>;

/// The state of one load: the source (for positions), the environment, and the errors so far.
pub struct Cx<'a> {
    file: String,
    src: &'a str,
    /// Relative paths in the file are resolved against this directory.
    base_dir: PathBuf,
    pub env: Env<'a>,
    pub errors: Vec<ConfigError>,
}

impl<'a> Cx<'a> {
    pub fn new(path: &Path, src: &'a str, env: Env<'a>) -> Self {
        Cx {
            file: path.display().to_string(),
            src,
            base_dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            env,
            errors: Vec::new(),
        }
    }

    /// 1-based line and column of a byte offset; columns count characters, as editors do.
    pub fn position(&self, offset: usize) -> (usize, usize) {
        // toml_edit's offsets are on character boundaries; any other counts from the
        // character it falls in.
        let mut end = offset.min(self.src.len());
        while !self.src.is_char_boundary(end) {
            end -= 1;
        }
        let before = &self.src[..end];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let line = before.matches('\n').count() + 1;
        (line, before[line_start..].chars().count() + 1)
    }

    pub fn error(&mut self, span: &Span, field: &str, message: impl Into<String>) {
        let (line, col) = self.position(span.as_ref().map_or(0, |r| r.start));
        self.push(line, col, field, message.into());
    }

    /// An error that has no place in the file (it comes from the environment).
    pub fn error_unplaced(&mut self, field: &str, message: impl Into<String>) {
        self.push(0, 0, field, message.into());
    }

    fn push(&mut self, line: usize, col: usize, field: &str, message: String) {
        let (file, field) = (self.file.clone(), field.to_string());
        self.errors.push(ConfigError {
            file,
            line,
            col,
            field,
            message,
        });
    }

    /// The errors in file order, which is what an operator fixing the file wants (readers
    /// run section by section). The sort is stable: errors at one place keep their order.
    pub fn take_errors(&mut self) -> ConfigErrors {
        self.errors.sort_by_key(|e| (e.line, e.col));
        ConfigErrors(std::mem::take(&mut self.errors))
    }

    pub fn type_error(&mut self, node: &Node<'_>, expected: &str) {
        let message = format!("expected {expected}, found {}", node.type_name());
        self.error(&node.span, &node.path, message);
    }

    /// The value of `result`, or None after reporting its message at `node`.
    pub fn check<T, E: Into<String>>(
        &mut self,
        node: &Node<'_>,
        result: Result<T, E>,
    ) -> Option<T> {
        result
            .map_err(|m| self.error(&node.span, &node.path, m))
            .ok()
    }

    /// `items`, or None after reporting `message` when there are none.
    pub fn non_empty<T>(
        &mut self,
        node: &Node<'_>,
        items: Vec<T>,
        message: &str,
    ) -> Option<Vec<T>> {
        if items.is_empty() {
            return self.check(node, Err(message));
        }
        Some(items)
    }

    // Typed values: each reports its own errors and returns None after reporting.

    /// What `get` finds in the node's value, or None after reporting that it is not `expected`.
    fn typed<'d, T>(
        &mut self,
        node: &Node<'d>,
        expected: &str,
        get: impl FnOnce(&'d Value) -> Option<T>,
    ) -> Option<T> {
        let found = node.value().and_then(get);
        if found.is_none() {
            self.type_error(node, expected);
        }
        found
    }

    /// A string, after `${NAME}` expansion.
    pub fn string(&mut self, node: &Node<'_>) -> Option<String> {
        let s = self.typed(node, "a string", Value::as_str)?;
        let expanded = expand(s, self.env);
        for problem in expanded.as_ref().err().into_iter().flatten() {
            self.error(&node.span, &node.path, problem);
        }
        expanded.ok()
    }

    /// A string read by one of the value syntaxes in [`super::syntax`].
    pub fn parse<T>(
        &mut self,
        node: &Node<'_>,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        let s = self.string(node)?;
        self.check(node, parse(&s))
    }

    /// An integer in `min..=max`, converted to the field's type (always possible in range).
    pub fn int<T: TryFrom<i64>>(&mut self, node: &Node<'_>, min: i64, max: i64) -> Option<T> {
        let i = self.typed(node, "an integer", Value::as_integer)?;
        if !(min..=max).contains(&i) {
            return self.check(
                node,
                Err(format!("must be between {min} and {max}, got {i}")),
            );
        }
        T::try_from(i).ok()
    }

    pub fn boolean(&mut self, node: &Node<'_>) -> Option<bool> {
        self.typed(node, "a boolean (true or false)", Value::as_bool)
    }

    /// One of a fixed set of strings.
    pub fn choice<T: Copy>(&mut self, node: &Node<'_>, options: &[(&str, T)]) -> Option<T> {
        let s = self.string(node)?;
        let found = options.iter().find(|(name, _)| *name == s).map(|(_, v)| *v);
        let names: Vec<String> = options.iter().map(|(n, _)| format!("{n:?}")).collect();
        let message = || format!("expected one of {}, got {s:?}", names.join(", "));
        self.check(node, found.ok_or_else(message))
    }

    /// A duration string, greater than zero and at most 366 days.
    pub fn duration(&mut self, node: &Node<'_>) -> Option<Duration> {
        self.parse(node, positive_duration)
    }

    /// A size (`"10MiB"`), greater than zero.
    pub fn size(&mut self, node: &Node<'_>) -> Option<u64> {
        self.parse(node, positive_size)
    }

    pub fn socket_addr(&mut self, node: &Node<'_>) -> Option<SocketAddr> {
        self.parse(node, parse_socket_addr)
    }

    /// A name that ends up in metric labels and bucket strings.
    pub fn name(&mut self, node: &Node<'_>, what: &str) -> Option<String> {
        self.parse(node, |s| check_name(s, what).map(|()| s.to_string()))
    }

    /// The elements of an array, each with its own path and span.
    pub fn array<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        let elements = self
            .typed(node, "an array", Value::as_array)?
            .iter()
            .enumerate();
        Some(
            elements
                .map(|(i, v)| node.element(i, Raw::Value(v), v.span()))
                .collect(),
        )
    }

    /// An array whose elements are each parsed by `parse`; None if anything was wrong (all
    /// bad elements are reported, not just the first).
    pub fn list<'d, T>(
        &mut self,
        node: &Node<'d>,
        mut parse: impl FnMut(&mut Self, &Node<'d>) -> Option<T>,
    ) -> Option<Vec<T>> {
        let parsed: Vec<Option<T>> = self.array(node)?.iter().map(|e| parse(self, e)).collect();
        parsed.into_iter().collect()
    }

    /// A `[[name]]` array of tables (or an array of inline tables, which TOML treats alike).
    pub fn tables<'d>(&mut self, node: &Node<'d>) -> Option<Vec<Node<'d>>> {
        match node.raw {
            Raw::Item(Item::ArrayOfTables(a)) => {
                let elements = a.iter().enumerate();
                Some(
                    elements
                        .map(|(i, t)| node.element(i, Raw::Table(t), t.span()))
                        .collect(),
                )
            }
            _ if matches!(node.value(), Some(Value::Array(_))) => self.array(node),
            _ => {
                let expected = format!("an array of tables ([[{}]])", toml_header(&node.path));
                self.type_error(node, &expected);
                None
            }
        }
    }

    /// A path to a file that must exist and be readable, resolved against the config file's
    /// directory when relative.
    pub fn readable_file(&mut self, node: &Node<'_>) -> Option<PathBuf> {
        let s = self.string(node)?;
        if s.is_empty() {
            return self.check(node, Err("must not be empty"));
        }
        let path = self.base_dir.join(&s);
        // Opening proves readability for this user; the metadata check catches directories,
        // which open fine on Unix but cannot be read as PEM.
        let problem = match std::fs::File::open(&path).and_then(|f| f.metadata()) {
            Ok(m) if m.is_file() => return Some(path),
            Ok(_) => "is not a regular file".to_string(),
            Err(e) => e.to_string(),
        };
        self.check(
            node,
            Err(format!("cannot read {}: {problem}", path.display())),
        )
    }
}

/// What a [`Node`] points at: toml_edit has three shapes for "a thing at a path".
#[derive(Clone, Copy)]
pub enum Raw<'d> {
    Item(&'d Item),
    Value(&'d Value),
    /// An element of an array of tables.
    Table(&'d Table),
}

/// A value in the document with its field path and position.
#[derive(Clone)]
pub struct Node<'d> {
    pub raw: Raw<'d>,
    pub path: String,
    /// The value's span, or its key's when the value has none (implicit and dotted tables).
    pub span: Span,
}

impl<'d> Node<'d> {
    pub fn value(&self) -> Option<&'d Value> {
        match self.raw {
            Raw::Item(Item::Value(v)) | Raw::Value(v) => Some(v),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self.raw {
            Raw::Item(i) => i.type_name(),
            Raw::Value(v) => v.type_name(),
            Raw::Table(_) => "table",
        }
    }

    pub fn table_like(&self) -> Option<&'d dyn TableLike> {
        match self.raw {
            Raw::Item(i) => i.as_table_like(),
            Raw::Value(v) => v.as_inline_table().map(|t| t as &dyn TableLike),
            Raw::Table(t) => Some(t),
        }
    }

    /// Element `i` of this array; it has the array's span when it has none of its own.
    fn element(&self, i: usize, raw: Raw<'d>, span: Span) -> Node<'d> {
        let path = format!("{}[{i}]", self.path);
        let span = span.or_else(|| self.span.clone());
        Node { raw, path, span }
    }
}

/// Reads one table: hands out its fields by name and, at the end, reports every key nobody
/// asked for. A typo must be an error, not a silently ignored limit. The keys a table knows
/// are exactly those its reader asks for (every reader asks for all of them, whatever the
/// file holds), so the list of known keys cannot drift from the code that reads them.
pub struct TableReader<'d> {
    /// None for an absent table (or one that is not a table), which yields only defaults.
    table: Option<&'d dyn TableLike>,
    pub path: String,
    /// Where "missing required field" points: the table's header.
    pub span: Span,
    /// Every key asked for so far, in the order asked.
    known: RefCell<Vec<&'d str>>,
}

impl<'d> TableReader<'d> {
    pub fn new(table: Option<&'d dyn TableLike>, path: String, span: Span) -> Self {
        TableReader {
            table,
            path,
            span,
            known: RefCell::default(),
        }
    }

    /// A reader over `node`; None (after reporting) when it is not a table.
    pub fn of(cx: &mut Cx<'_>, node: &Node<'d>) -> Option<Self> {
        let Some(table) = node.table_like() else {
            cx.type_error(node, "a table");
            return None;
        };
        Some(TableReader::new(
            Some(table),
            node.path.clone(),
            node.span.clone(),
        ))
    }

    /// The sub-table `key`; absent, or not a table (reported), it reads as an empty table.
    pub fn table(&self, cx: &mut Cx<'_>, key: &'static str) -> TableReader<'d> {
        let reader = self.get(key).and_then(|n| TableReader::of(cx, &n));
        reader.unwrap_or_else(|| TableReader::new(None, self.field_path(key), None))
    }

    pub fn field_path(&self, key: &str) -> String {
        join_path(&self.path, key)
    }

    pub fn get(&self, key: &'static str) -> Option<Node<'d>> {
        self.known.borrow_mut().push(key);
        let (k, item) = self.table?.get_key_value(key)?;
        if item.is_none() {
            return None;
        }
        let (path, span) = (self.field_path(key), item.span().or_else(|| k.span()));
        Some(Node {
            raw: Raw::Item(item),
            path,
            span,
        })
    }

    /// A required field read by `read`; None when missing or invalid (both reported).
    pub fn req<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> Option<T> {
        let node = self.get(key);
        if node.is_none() {
            cx.error(&self.span, &self.field_path(key), "missing required field");
        }
        read(cx, &node?)
    }

    /// An optional field read by `read`; None when absent or invalid (reported).
    pub fn opt<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> Option<T> {
        self.get(key).and_then(|n| read(cx, &n))
    }

    /// An optional field with a default, which also stands in for an invalid value (reported).
    pub fn or<'a, T>(
        &self,
        cx: &mut Cx<'a>,
        key: &'static str,
        default: T,
        read: impl FnOnce(&mut Cx<'a>, &Node<'d>) -> Option<T>,
    ) -> T {
        self.opt(cx, key, read).unwrap_or(default)
    }

    /// Reports every key that was not asked for.
    pub fn finish(self, cx: &mut Cx<'_>) {
        let Some(table) = self.table else { return };
        let known = self.known.borrow();
        for (key, item) in table.iter().filter(|(key, _)| !known.contains(key)) {
            let key_span = table.key(key).and_then(|k| k.span());
            let span = key_span
                .or_else(|| item.span())
                .or_else(|| self.span.clone());
            let hint = match closest(key, &known) {
                Some(k) => format!("; did you mean `{k}`?"),
                None => format!("; expected one of: {}", known.join(", ")),
            };
            cx.error(&span, &self.field_path(key), format!("unknown field{hint}"));
        }
    }
}

/// `parent.key`; a key that is not a bare TOML key is quoted, so the path reads back as TOML.
pub fn join_path(parent: &str, key: &str) -> String {
    let bare = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    let key = match !key.is_empty() && key.bytes().all(bare) {
        true => key.to_string(),
        false => format!("{key:?}"),
    };
    match parent {
        "" => key,
        _ => format!("{parent}.{key}"),
    }
}

/// A field path as a TOML table header: `routes[0].limits` -> `routes.limits`.
fn toml_header(path: &str) -> String {
    let mut in_index = false;
    let keep = |c: &char| match c {
        '[' | ']' => {
            in_index = *c == '[';
            false
        }
        _ => !in_index,
    };
    path.chars().filter(keep).collect()
}

/// The known key closest to a typo, if it is close enough to be a plausible misspelling.
fn closest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let distances = known.iter().map(|k| (strsim::levenshtein(key, k), *k));
    let plausible = distances.filter(|(d, k)| *d <= if k.len() <= 4 { 1 } else { 2 });
    plausible.min_by_key(|(d, _)| *d).map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_count_characters_and_an_offset_inside_one_counts_from_it() {
        let src = "a = 1\nnamé = \"x\"\n";
        let cx = Cx::new(Path::new("t.toml"), src, &|_| None);
        assert_eq!(cx.position(0), (1, 1));
        assert_eq!(cx.position(6), (2, 1));
        // `é` is two bytes; the space after it is the fifth character of the line.
        let space = src.rfind(" = ").expect("the second line's ` = `");
        assert_eq!(cx.position(space), (2, 5));
        // Inside `é` (its second byte): the column of `é` itself, not line 1, column 1.
        let inside = src.find('é').expect("an `é`") + 1;
        assert_eq!(cx.position(inside), (2, 4));
        // Past the end: the end.
        assert_eq!(cx.position(10_000), (3, 1));
    }
}

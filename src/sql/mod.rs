//! Typed statements: each is rendered once per table and bound through named fields.
//!
//! A statement's parameters are a struct declared with [`statement!`]: one named field per
//! parameter, with its SQL type. The SQL text names a parameter through the struct's
//! associated constant of the same name (`Dedupe::key` renders as `$2`), and the struct
//! binds each field in its own place, so a text and its binds cannot disagree: a misspelt
//! parameter does not compile, and every parameter is bound exactly where the text uses it.
//!
//! The text is rendered once, when an [`Outbox`](crate::Outbox) is built, into a [`Sql`].
//! Each statement lives beside the code that runs it; [`TableStatements`] only gathers them per
//! table. Identifiers come from a validated [`TableName`] and are always quoted; every
//! value is a bound parameter. Durations are bound as microseconds (`bigint`) and turned
//! into intervals by PostgreSQL, so all times come from the database clock.
//!
//! Diesel's `sql_query` is never statement-cached, so every call would be parsed and
//! planned again; for the outbox's CTEs that costs more than executing them. A bound
//! statement is a query Diesel (sync and async) caches per connection by its SQL text and
//! bind types.

pub(crate) mod plan;
mod statements;
pub(crate) mod table;

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::Untyped;

#[cfg(test)]
pub(crate) use self::statements::Listed;
pub(crate) use self::statements::TableStatements;
pub(crate) use self::table::TableName;
pub use self::table::WAKE_LOCK_CLASS;

/// A statement's parameters, declared with [`statement!`].
pub(crate) trait Params: Bind {
    /// How many parameters there are.
    const COUNT: usize;
    /// Their SQL types as written in [`statement!`], in the order of their numbers.
    #[cfg(test)]
    fn types() -> Vec<&'static str>;
}

/// Binding of parameters by number; what is left of [`Params`] once a statement is bound.
pub(crate) trait Bind: Send {
    /// Binds parameter number `slot` (zero-based) at the current place in the text.
    fn push_param<'b>(&'b self, slot: usize, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()>;
}

/// How a parameter is written in a statement's text: `$n`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placeholder(pub(crate) usize);

impl Placeholder {
    /// The placeholder of parameter `name` among `names`; fails to compile (in a constant)
    /// for a name that is not there.
    pub(crate) const fn of(names: &[&str], name: &str) -> Self {
        let mut i = 0;
        while i < names.len() {
            if same(names[i].as_bytes(), name.as_bytes()) {
                return Placeholder(i);
            }
            i += 1;
        }
        panic!("no such parameter")
    }
}

const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl fmt::Display for Placeholder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "${}", self.0 + 1)
    }
}

/// Declares the parameters of a statement: a struct with one field per parameter, given
/// as `name: SqlType = RustType`, numbered in the order written. Each name is also an
/// associated constant ([`Placeholder`]) for the statement's text.
macro_rules! statement {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_attr:meta])* $field:ident : $sql_type:ty = $rust_type:ty ),* $(,)?
        }
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $( $(#[$field_attr])* pub(crate) $field: $rust_type, )*
        }

        #[allow(non_upper_case_globals, dead_code)]
        impl $name {
            /// The parameters' names, in the order of their numbers.
            const NAMES: &'static [&'static str] = &[$(stringify!($field)),*];
            /// The parameters' SQL types as written (`BigInt`, `Array<Text>`), in the
            /// order of their numbers, for the snapshot.
            #[cfg(test)]
            const TYPES: &'static [&'static str] = &[$(stringify!($sql_type)),*];
            $(
                pub(crate) const $field: $crate::sql::Placeholder =
                    $crate::sql::Placeholder::of(Self::NAMES, stringify!($field));
            )*
        }

        impl $crate::sql::Params for $name {
            const COUNT: usize = Self::NAMES.len();
            #[cfg(test)]
            fn types() -> Vec<&'static str> {
                Self::TYPES.to_vec()
            }
        }

        impl $crate::sql::Bind for $name {
            #[allow(unused_variables)]
            fn push_param<'b>(
                &'b self,
                slot: usize,
                out: &mut diesel::query_builder::AstPass<'_, 'b, diesel::pg::Pg>,
            ) -> diesel::QueryResult<()> {
                $(
                    if slot == Self::$field.0 {
                        return out.push_bind_param::<$sql_type, _>(&self.$field);
                    }
                )*
                unreachable!("the text was checked against the parameters when rendered")
            }
        }
    };
}
pub(crate) use statement;

/// A statement's text for one table, split at its placeholders; `P` is its parameters.
pub(crate) struct Sql<P> {
    text: String,
    pieces: Vec<String>,
    /// For each placeholder occurrence, its zero-based parameter number.
    slots: Vec<usize>,
    params: PhantomData<fn(P)>,
}

impl<P> fmt::Debug for Sql<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Sql").field(&self.text).finish()
    }
}

impl<P> Clone for Sql<P> {
    fn clone(&self) -> Self {
        Sql {
            text: self.text.clone(),
            pieces: self.pieces.clone(),
            slots: self.slots.clone(),
            params: PhantomData,
        }
    }
}

impl<P: Params> Sql<P> {
    /// Splits a rendered text at its placeholders.
    ///
    /// # Panics
    /// When the text uses a parameter `P` does not have, or leaves one unused: a statement
    /// written wrong, found by any test that builds an `Outbox`.
    pub(crate) fn new(text: String) -> Self {
        let mut pieces = Vec::new();
        let mut slots = Vec::new();
        let mut current = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '$' && chars.peek().is_some_and(|d| ('1'..='9').contains(d)) {
                // The crate's statements hold no `$` inside string literals.
                let mut n = 0usize;
                while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                    n = n * 10 + d as usize;
                    chars.next();
                }
                pieces.push(std::mem::take(&mut current));
                slots.push(n - 1);
            } else {
                current.push(c);
            }
        }
        pieces.push(current);
        for i in 0..P::COUNT {
            assert!(
                slots.contains(&i),
                "parameter ${} is not used in {text}",
                i + 1
            );
        }
        assert!(
            slots.iter().all(|s| *s < P::COUNT),
            "a placeholder has no parameter in {text}"
        );
        Sql {
            text,
            pieces,
            slots,
            params: PhantomData,
        }
    }

    /// The SQL as rendered, with `$n` placeholders.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The statement as the snapshot lists it under `name`: with a comment line naming its
    /// parameters' PostgreSQL types (what the crate binds them as), when it has any.
    #[cfg(test)]
    pub(crate) fn named(&self, name: &str) -> (String, &str) {
        let mut name = name.to_owned();
        if P::COUNT > 0 {
            let types: Vec<String> = P::types().iter().map(|t| pg_type(t)).collect();
            name = format!("{name}\n-- params: {}", types.join(", "));
        }
        (name, &self.text)
    }

    /// [`Sql::named`] for a statement that runs after the planner settings `plan` in its
    /// transaction: a comment line `-- under: <plan>` too, which `tests/plans.rs` applies
    /// before it plans the statement.
    #[cfg(test)]
    pub(crate) fn named_under(&self, name: &str, plan: &str) -> (String, &str) {
        let (name, text) = self.named(name);
        (format!("{name}\n-- under: {plan}"), text)
    }

    /// The statement with its parameters: a query for either flavour of `RunQueryDsl`.
    pub(crate) fn bind<'a>(&'a self, params: P) -> Bound<'a>
    where
        P: 'a,
    {
        Bound {
            pieces: &self.pieces,
            slots: &self.slots,
            params: Box::new(params),
        }
    }
}

/// A statement with its parameters, runnable with either flavour of `RunQueryDsl`.
#[must_use = "queries run only when loaded or executed"]
pub(crate) struct Bound<'a> {
    pieces: &'a [String],
    slots: &'a [usize],
    params: Box<dyn Bind + 'a>,
}

impl QueryFragment<Pg> for Bound<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        for (piece, slot) in self.pieces.iter().zip(self.slots) {
            out.push_sql(piece);
            self.params.push_param(*slot, &mut out)?;
        }
        out.push_sql(self.pieces.last().map_or("", String::as_str));
        Ok(())
    }
}

impl QueryId for Bound<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Bound<'_> {
    type SqlType = Untyped;
}

impl<Conn> diesel::RunQueryDsl<Conn> for Bound<'_> {}

/// The parameters `P` followed by one more: the NOTIFY channel of a notifying enqueue.
pub(crate) struct Notifying<P> {
    pub(crate) params: P,
    pub(crate) channel: String,
}

#[allow(non_upper_case_globals)]
impl<P: Params> Notifying<P> {
    /// The channel's placeholder, after those of `P`.
    pub(crate) const channel: Placeholder = Placeholder(P::COUNT);
}

impl<P: Params> Params for Notifying<P> {
    const COUNT: usize = P::COUNT + 1;
    #[cfg(test)]
    fn types() -> Vec<&'static str> {
        let mut types = P::types();
        types.push("Text");
        types
    }
}

impl<P: Params> Bind for Notifying<P> {
    fn push_param<'b>(&'b self, slot: usize, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if slot == P::COUNT {
            out.push_bind_param::<diesel::sql_types::Text, _>(&self.channel)
        } else {
            self.params.push_param(slot, out)
        }
    }
}

statement! {
    /// A statement without parameters.
    pub(crate) struct NoParams {}
}

/// The PostgreSQL type of a diesel SQL type as [`statement!`] names it (`Array<Text>`:
/// `text[]`; `Nullable` binds as the type it wraps).
#[cfg(test)]
fn pg_type(diesel: &str) -> String {
    let diesel = diesel.replace(' ', "");
    if let Some(inner) = diesel
        .strip_prefix("Array<")
        .and_then(|t| t.strip_suffix('>'))
    {
        return format!("{}[]", pg_type(inner));
    }
    if let Some(inner) = diesel
        .strip_prefix("Nullable<")
        .and_then(|t| t.strip_suffix('>'))
    {
        return pg_type(inner);
    }
    match diesel.as_str() {
        "BigInt" => "bigint",
        "Integer" => "integer",
        "Text" => "text",
        "Bool" => "boolean",
        "Bytea" => "bytea",
        "Jsonb" => "jsonb",
        other => panic!("no PostgreSQL type known for {other}: add it to pg_type"),
    }
    .to_owned()
}

/// A duration as the microseconds bound for it (saturating).
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Microseconds read back from the database as a duration (negative ones as zero).
pub(crate) fn from_micros(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::sql_types::{BigInt, Text};

    statement! {
        struct Pair {
            first: Text = String,
            second: BigInt = i64,
        }
    }

    #[test]
    fn names_number_the_parameters_in_declaration_order() {
        assert_eq!(Pair::first.to_string(), "$1");
        assert_eq!(Pair::second.to_string(), "$2");
        let sql = Sql::<Pair>::new(format!(
            "SELECT {b}, {a} || '$' WHERE x = {a}",
            a = Pair::first,
            b = Pair::second
        ));
        assert_eq!(sql.slots, vec![1, 0, 0]);
        assert_eq!(sql.pieces, vec!["SELECT ", ", ", " || '$' WHERE x = ", ""]);
        assert_eq!(sql.text(), "SELECT $2, $1 || '$' WHERE x = $1");
    }

    #[test]
    #[should_panic(expected = "parameter $2 is not used")]
    fn a_parameter_the_text_leaves_out_is_caught_when_rendered() {
        let _ = Sql::<Pair>::new(format!("SELECT {}", Pair::first));
    }

    #[test]
    #[should_panic(expected = "a placeholder has no parameter")]
    fn a_placeholder_without_a_parameter_is_caught_when_rendered() {
        let _ = Sql::<Pair>::new("SELECT $1, $2, $3".to_owned());
    }
}

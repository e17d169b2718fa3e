//! Running a rendered statement as a cached prepared statement.
//!
//! Diesel's `sql_query` is never statement-cached, so every call would be parsed and planned
//! again; for the outbox's CTEs that costs more than executing them. A [`Statement`] is
//! rendered once per table and run through [`Prepared`], which Diesel (sync and async)
//! caches per connection by its SQL text and bind types.

use std::marker::PhantomData;

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Untyped};

/// SQL text with `$n` placeholders, split once so each placeholder can be bound in place.
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    text: String,
    pieces: Vec<String>,
    /// For each placeholder occurrence, its zero-based parameter number.
    slots: Vec<usize>,
}

impl Statement {
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
        Statement {
            text,
            pieces,
            slots,
        }
    }

    /// The SQL as rendered, with `$n` placeholders.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// Starts a query on this statement; bind every parameter in order.
    pub(crate) fn query(&self) -> Prepared<'_> {
        Prepared {
            statement: self,
            binds: Vec::new(),
        }
    }
}

/// A bound value of a known SQL type.
trait Bind: Send {
    fn push<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()>;
}

struct Typed<ST, U> {
    value: U,
    sql_type: PhantomData<fn() -> ST>,
}

impl<ST, U> Bind for Typed<ST, U>
where
    Pg: HasSqlType<ST>,
    U: ToSql<ST, Pg> + Send,
{
    fn push<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_bind_param::<ST, U>(&self.value)
    }
}

/// A [`Statement`] with its parameters, runnable with either flavour of `RunQueryDsl`.
#[must_use = "queries run only when loaded or executed"]
pub(crate) struct Prepared<'a> {
    statement: &'a Statement,
    binds: Vec<Box<dyn Bind + 'a>>,
}

impl<'a> Prepared<'a> {
    /// Binds the next parameter (`$1`, then `$2`, ...).
    pub(crate) fn bind<ST, U>(mut self, value: U) -> Self
    where
        Pg: HasSqlType<ST>,
        U: ToSql<ST, Pg> + Send + 'a,
        ST: 'a,
    {
        self.binds.push(Box::new(Typed {
            value,
            sql_type: PhantomData,
        }));
        self
    }
}

impl QueryFragment<Pg> for Prepared<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let s = self.statement;
        for (piece, slot) in s.pieces.iter().zip(&s.slots) {
            out.push_sql(piece);
            let bind = self.binds.get(*slot).ok_or_else(|| {
                diesel::result::Error::QueryBuilderError(
                    format!("parameter ${} is not bound", slot + 1).into(),
                )
            })?;
            bind.push(&mut out)?;
        }
        out.push_sql(s.pieces.last().map_or("", String::as_str));
        Ok(())
    }
}

impl QueryId for Prepared<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Prepared<'_> {
    type SqlType = Untyped;
}

impl<Conn> diesel::RunQueryDsl<Conn> for Prepared<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_on_placeholders_only() {
        let s = Statement::new("SELECT $1, $12 || '$' WHERE x = $1".into());
        assert_eq!(s.slots, vec![0, 11, 0]);
        assert_eq!(s.pieces, vec!["SELECT ", ", ", " || '$' WHERE x = ", ""]);
        assert_eq!(s.text(), "SELECT $1, $12 || '$' WHERE x = $1");
    }
}

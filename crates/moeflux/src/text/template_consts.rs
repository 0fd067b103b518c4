//! The constant expressions a chat template folds stay small.
//!
//! MiniJinja evaluates an expression whose operands are all literals when it
//! compiles the template (`{{ [0] * 10000 * 10000 }}` becomes one constant
//! of 10^8 items), before any of the render-time checks of
//! [`template_budget`](super::template_budget) can run. Only a repetition
//! (`*` of a string or sequence by an integer) makes such a constant larger
//! than the source text, so every constant `*` in the parsed template is
//! sized before MiniJinja compiles it: the bytes of the strings and 16 bytes
//! per sequence item of all of them together must stay within the render's
//! byte cap (real templates repeat a few spaces or dashes).

use minijinja::machinery::ast::{self, BinOpKind, CallArg, Expr, Stmt};
use minijinja::value::ObjectRepr;
use minijinja::Value;

/// Why a check failed.
type Over = String;

/// Bytes a sequence item counts for (as the render's item cap,
/// [`TemplateBudget::max_items`](super::template_budget::TemplateBudget::max_items)).
const ITEM_BYTES: usize = 16;

/// Fails when the constant repetitions in `source` would build more than
/// `limit` bytes when it compiles. Syntax errors are left to the compile
/// that follows.
pub(crate) fn check(
    name: &str,
    source: &str,
    syntax: minijinja::syntax::SyntaxConfig,
    limit: usize,
) -> Result<(), Over> {
    let Ok(tree) = minijinja::machinery::parse(source, name, syntax) else {
        return Ok(());
    };
    Folded { bytes: 0, limit }.stmt(&tree)
}

struct Folded {
    bytes: usize,
    limit: usize,
}

impl Folded {
    fn stmts(&mut self, body: &[Stmt]) -> Result<(), Over> {
        body.iter().try_for_each(|s| self.stmt(s))
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), Over> {
        match s {
            Stmt::Template(t) => self.stmts(&t.children),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => Ok(()),
            Stmt::ForLoop(f) => {
                self.expr(&f.target)?;
                self.expr(&f.iter)?;
                self.opt(&f.filter_expr)?;
                self.stmts(&f.body)?;
                self.stmts(&f.else_body)
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr)?;
                self.stmts(&c.true_body)?;
                self.stmts(&c.false_body)
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.expr(target)?;
                    self.expr(value)?;
                }
                self.stmts(&w.body)
            }
            Stmt::Set(set) => {
                self.expr(&set.target)?;
                self.expr(&set.expr)
            }
            Stmt::SetBlock(set) => {
                self.expr(&set.target)?;
                self.opt(&set.filter)?;
                self.stmts(&set.body)
            }
            Stmt::AutoEscape(a) => {
                self.expr(&a.enabled)?;
                self.stmts(&a.body)
            }
            Stmt::FilterBlock(f) => {
                self.expr(&f.filter)?;
                self.stmts(&f.body)
            }
            Stmt::Block(b) => self.stmts(&b.body),
            Stmt::Import(i) => {
                self.expr(&i.expr)?;
                self.expr(&i.name)
            }
            Stmt::FromImport(i) => {
                self.expr(&i.expr)?;
                for (name, alias) in &i.names {
                    self.expr(name)?;
                    self.opt(alias)?;
                }
                Ok(())
            }
            Stmt::Extends(e) => self.expr(&e.name),
            Stmt::Include(i) => self.expr(&i.name),
            Stmt::Macro(m) => self.macro_decl(m),
            Stmt::CallBlock(c) => {
                self.call(&c.call)?;
                self.macro_decl(&c.macro_decl)
            }
            Stmt::Do(d) => self.call(&d.call),
        }
    }

    fn macro_decl(&mut self, m: &ast::Macro) -> Result<(), Over> {
        m.args.iter().try_for_each(|e| self.expr(e))?;
        m.defaults.iter().try_for_each(|e| self.expr(e))?;
        self.stmts(&m.body)
    }

    fn call(&mut self, c: &ast::Call) -> Result<(), Over> {
        self.expr(&c.expr)?;
        self.args(&c.args)
    }

    fn args(&mut self, args: &[CallArg]) -> Result<(), Over> {
        args.iter().try_for_each(|a| match a {
            CallArg::Pos(e)
            | CallArg::Kwarg(_, e)
            | CallArg::PosSplat(e)
            | CallArg::KwargSplat(e) => self.expr(e),
        })
    }

    fn opt(&mut self, e: &Option<Expr>) -> Result<(), Over> {
        e.as_ref().map_or(Ok(()), |e| self.expr(e))
    }

    /// Children first, so a repetition is sized only once the operands it
    /// would fold are known to be small.
    fn expr(&mut self, e: &Expr) -> Result<(), Over> {
        match e {
            Expr::Var(_) | Expr::Const(_) => Ok(()),
            Expr::Slice(s) => {
                self.expr(&s.expr)?;
                self.opt(&s.start)?;
                self.opt(&s.stop)?;
                self.opt(&s.step)
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                self.expr(&b.left)?;
                self.expr(&b.right)?;
                if matches!(b.op, BinOpKind::Mul) {
                    self.repetition(&b.left, &b.right)?;
                }
                Ok(())
            }
            Expr::Compare(c) => {
                self.expr(&c.expr)?;
                c.ops.iter().try_for_each(|op| self.expr(&op.expr))
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr)?;
                self.expr(&i.true_expr)?;
                self.opt(&i.false_expr)
            }
            Expr::Filter(f) => {
                self.opt(&f.expr)?;
                self.args(&f.args)
            }
            Expr::Test(t) => {
                self.expr(&t.expr)?;
                self.args(&t.args)
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr)?;
                self.expr(&g.subscript_expr)
            }
            Expr::Call(c) => self.call(c),
            Expr::List(l) => l.items.iter().try_for_each(|e| self.expr(e)),
            Expr::Tuple(t) => t.items.iter().try_for_each(|e| self.expr(e)),
            Expr::Map(m) => {
                m.keys.iter().try_for_each(|e| self.expr(e))?;
                m.values.iter().try_for_each(|e| self.expr(e))
            }
        }
    }

    /// Counts `left * right` when MiniJinja would fold it into a repeated
    /// string or sequence.
    fn repetition(&mut self, left: &Expr, right: &Expr) -> Result<(), Over> {
        let (Some(l), Some(r)) = (left.as_const(), right.as_const()) else {
            return Ok(());
        };
        let Some((unit, times)) = repeated_size(&l, &r).or_else(|| repeated_size(&r, &l)) else {
            return Ok(());
        };
        let limit = self.limit;
        self.bytes = unit
            .checked_mul(times)
            .and_then(|b| b.checked_add(self.bytes))
            .filter(|&b| b <= limit)
            .ok_or_else(|| {
                format!(
                    "its constant repetitions (such as `'-' * 10`) would build more than \
                     the {limit} bytes allowed when it compiles"
                )
            })?;
        Ok(())
    }
}

/// The bytes of `seq` and how many times `n` repeats it, when MiniJinja's
/// `seq * n` repeats a string or sequence (else `None`: arithmetic, or an
/// error MiniJinja reports itself).
fn repeated_size(seq: &Value, n: &Value) -> Option<(usize, usize)> {
    let times = n.as_usize()?;
    if let Some(s) = seq.as_str() {
        return Some((s.len(), times));
    }
    let obj = seq.as_object()?;
    matches!(obj.repr(), ObjectRepr::Iterable | ObjectRepr::Seq)
        .then(|| obj.enumerator_len())
        .flatten()
        .map(|len| (len.saturating_mul(ITEM_BYTES), times))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(src: &str) -> Result<(), Over> {
        check("t", src, Default::default(), 1 << 20)
    }

    #[test]
    fn small_repetitions_pass() {
        for src in [
            "{{ '-' * 10 }}",
            "{{ [0] * 3 * 4 }}",
            "{% set l = [[0] * 60000] * 60000 %}", // not folded: a list of a non-literal
            "{{ 'ab' * 1000 ~ 'x' * 2 }}",
            "{{ 3 * 4 * 100000000 }}",
            "{% for i in range(3) %}{{ ' ' * (i * 1000000) }}{% endfor %}",
            "{{ x * 100000000 }}",
            "{% macro m(a=' ' * 4) %}{{ a }}{% endmacro %}{{ m() }}",
        ] {
            assert!(run(src).is_ok(), "{src}");
        }
    }

    #[test]
    fn large_constant_repetitions_are_refused() {
        for src in [
            "{{ [0] * 10000 * 10000 }}",
            "{{ 'a' * 100000000 }}",
            "{{ 10 ** 8 * 'a' }}",
            "{% if x %}{{ ('ab' * 1000) * 100000 }}{% endif %}",
            "{{ ('ab' * 300000) ~ ('cd' * 300000) }}",
            "{% macro m(a=[0] * 100000000) %}{% endmacro %}",
            "{{ f(y=('a' * 600000, 'b' * 600000)) }}",
            "{% for i in range(2) %}{{ x ~ [1, 2] * 50000000 }}{% endfor %}",
        ] {
            let err = run(src).expect_err(src);
            assert!(err.contains("constant repetitions"), "{src}: {err}");
        }
    }
}

//! SQL92 message selectors: the JMS selector language as ActiveMQ and Artemis accept it
//! (STOMP `selector`), which is also RocketMQ's `bySql` grammar. Compiled once per
//! subscription ([`Selector::parse`]) into a small tree, then evaluated per message
//! ([`Selector::matches`]) against a [`Fields`] lookup.
//!
//! Grammar (keywords case-insensitive):
//!
//! ```text
//! or        := and ( OR and )*
//! and       := not ( AND not )*
//! not       := NOT not | predicate
//! predicate := sum [ ( = | <> | < | <= | > | >= ) sum
//!                  | [NOT] BETWEEN sum AND sum
//!                  | [NOT] IN ( literal , ... )
//!                  | [NOT] LIKE 'pattern' [ ESCAPE 'c' ]
//!                  | IS [NOT] NULL ]
//! sum       := product ( ( + | - ) product )*
//! product   := unary ( ( * | / | % ) unary )*
//! unary     := ( - | + ) unary | primary
//! primary   := literal | identifier | ( or )
//! literal   := 'string' ('' escapes a quote) | 42 | 42L | 0x2A | 1.5 | 1e3 | TRUE | FALSE
//! ```
//!
//! Semantics follow the JMS specification: an identifier with no value is NULL, and
//! comparisons, arithmetic, `BETWEEN`, `IN` and `LIKE` with NULL are *unknown*; `AND`,
//! `OR` and `NOT` use three-valued logic, and a message is selected only when the whole
//! expression is true. Exact (integer) and approximate (float) numbers compare with each
//! other; strings and booleans compare with `=` and `<>` only; comparing unlike types is
//! false. One exception, as ActiveMQ's `convertStringExpressions`: a string compared with
//! a number (or used in arithmetic) is read as a number when it is one, since STOMP
//! headers are strings (`price > 10` selects a STOMP message with header `price:12`).
//! Integer overflow and division by zero give unknown.
//!
//! Bounds against hostile input, checked while parsing (an error, never a truncation):
//! [`MAX_LEN`] bytes of text, [`MAX_DEPTH`] levels of nesting (the compiled tree's height,
//! which bounds the evaluator's recursion, as well as the parser's), [`MAX_IN`] items in
//! one `IN` list. Evaluation is then linear in the tree's size, except `LIKE`, which is at
//! most pattern length × value length.

use std::borrow::Cow;
use std::fmt;

/// Longest selector accepted, in bytes (ActiveMQ has no bound; 4 KiB is far beyond
/// any selector seen in practice and keeps a subscription's cost small).
pub const MAX_LEN: usize = 4096;
/// Deepest nesting of parentheses, `NOT`s, signs and operators, and the highest compiled
/// tree (operators on its longest path).
pub const MAX_DEPTH: usize = 100;
/// Most items in one `IN ( ... )` list.
pub const MAX_IN: usize = 256;

/// A value an identifier or literal stands for.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `TRUE` / `FALSE`, or a boolean header.
    Bool(bool),
    /// An exact number.
    Int(i64),
    /// An approximate number.
    Float(f64),
    /// A string.
    Str(String),
}

/// Where a selector finds the values of its identifiers (a message's headers and
/// properties). `None`: the message has no such property (NULL).
pub trait Fields {
    /// The value of identifier `name`.
    fn field(&self, name: &str) -> Option<Value>;
}

/// Why a selector does not compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectorError {
    /// Byte position in the selector text.
    pub pos: usize,
    /// What is wrong.
    pub msg: String,
}

impl fmt::Display for SelectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid selector at position {}: {}", self.pos, self.msg)
    }
}

impl std::error::Error for SelectorError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

/// One piece of a compiled `LIKE` pattern.
#[derive(Debug, Clone, PartialEq)]
enum Pat {
    /// `_`: any one character.
    One,
    /// `%`: any run of characters.
    Any,
    /// A character that must be there.
    Lit(char),
}

#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Lit(Value),
    Ident(String),
    Neg(Box<Expr>),
    Arith(Arith, Box<Expr>, Box<Expr>),
    Cmp(Cmp, Box<Expr>, Box<Expr>),
    Between {
        not: bool,
        e: Box<Expr>,
        lo: Box<Expr>,
        hi: Box<Expr>,
    },
    In {
        not: bool,
        e: Box<Expr>,
        list: Vec<Value>,
    },
    Like {
        not: bool,
        e: Box<Expr>,
        pat: Vec<Pat>,
    },
    IsNull {
        not: bool,
        e: Box<Expr>,
    },
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
}

/// A compiled selector.
#[derive(Debug, Clone, PartialEq)]
pub struct Selector {
    expr: Expr,
    text: String,
}

impl Selector {
    /// Compiles `text`; an error names the position and the problem.
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        if text.len() > MAX_LEN {
            return Err(SelectorError {
                pos: MAX_LEN,
                msg: format!("longer than {MAX_LEN} bytes"),
            });
        }
        let toks = lex(text)?;
        let mut p = Parser {
            toks,
            i: 0,
            depth: 0,
            end: text.len(),
        };
        let expr = p.or()?;
        if let Some((pos, t)) = p.toks.get(p.i) {
            return Err(SelectorError {
                pos: *pos,
                msg: format!("unexpected {t} after the end of the expression"),
            });
        }
        Ok(Selector {
            expr,
            text: text.to_string(),
        })
    }

    /// The selector's text as given.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the message `f` describes is selected (the expression is true, not false
    /// or unknown).
    pub fn matches(&self, f: &dyn Fields) -> bool {
        truth(eval(&self.expr, f).as_deref()) == Some(true)
    }

    /// The expression's three-valued result: `Some(true)`, `Some(false)` or `None`
    /// (unknown).
    pub fn evaluate(&self, f: &dyn Fields) -> Option<bool> {
        truth(eval(&self.expr, f).as_deref())
    }
}

// ---------------------------------------------------------------------------- lexer

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Kw(Kw),
    Str(String),
    Int(i64),
    Float(f64),
    Op(&'static str),
    LParen,
    RParen,
    Comma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kw {
    And,
    Or,
    Not,
    Between,
    In,
    Like,
    Escape,
    Is,
    Null,
    True,
    False,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "identifier '{s}'"),
            Tok::Kw(k) => write!(f, "keyword {}", format!("{k:?}").to_uppercase()),
            Tok::Str(s) => write!(f, "string '{s}'"),
            Tok::Int(n) => write!(f, "number {n}"),
            Tok::Float(n) => write!(f, "number {n}"),
            Tok::Op(o) => write!(f, "'{o}'"),
            Tok::LParen => f.write_str("'('"),
            Tok::RParen => f.write_str("')'"),
            Tok::Comma => f.write_str("','"),
        }
    }
}

fn keyword(s: &str) -> Option<Kw> {
    Some(match s.to_ascii_uppercase().as_str() {
        "AND" => Kw::And,
        "OR" => Kw::Or,
        "NOT" => Kw::Not,
        "BETWEEN" => Kw::Between,
        "IN" => Kw::In,
        "LIKE" => Kw::Like,
        "ESCAPE" => Kw::Escape,
        "IS" => Kw::Is,
        "NULL" => Kw::Null,
        "TRUE" => Kw::True,
        "FALSE" => Kw::False,
        _ => return None,
    })
}

fn err<T>(pos: usize, msg: impl Into<String>) -> Result<T, SelectorError> {
    Err(SelectorError {
        pos,
        msg: msg.into(),
    })
}

fn lex(text: &str) -> Result<Vec<(usize, Tok)>, SelectorError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let start = i;
        match c {
            b' ' | b'\t' | b'\r' | b'\n' | b'\x0c' => {
                i += 1;
                continue;
            }
            b'(' => {
                out.push((start, Tok::LParen));
                i += 1;
            }
            b')' => {
                out.push((start, Tok::RParen));
                i += 1;
            }
            b',' => {
                out.push((start, Tok::Comma));
                i += 1;
            }
            b'=' | b'+' | b'-' | b'*' | b'/' | b'%' => {
                let op = match c {
                    b'=' => "=",
                    b'+' => "+",
                    b'-' => "-",
                    b'*' => "*",
                    b'/' => "/",
                    _ => "%",
                };
                out.push((start, Tok::Op(op)));
                i += 1;
            }
            b'<' => {
                let (op, n) = match b.get(i + 1) {
                    Some(b'=') => ("<=", 2),
                    Some(b'>') => ("<>", 2),
                    _ => ("<", 1),
                };
                out.push((start, Tok::Op(op)));
                i += n;
            }
            b'>' => {
                let (op, n) = match b.get(i + 1) {
                    Some(b'=') => (">=", 2),
                    _ => (">", 1),
                };
                out.push((start, Tok::Op(op)));
                i += n;
            }
            b'\'' => {
                let (tok, n) = string_literal(b, i)?;
                out.push((start, tok));
                i += n;
            }
            b'0'..=b'9' | b'.' => {
                let (tok, n) = number(text, i)?;
                out.push((start, tok));
                i += n;
            }
            _ => {
                let (tok, n) = word(text, i)?;
                out.push((start, tok));
                i += n;
            }
        }
    }
    Ok(out)
}

/// A quoted string literal starting at `i` (`''` inside is one quote): returns the token
/// and its length in bytes, quotes included.
fn string_literal(b: &[u8], start: usize) -> Result<(Tok, usize), SelectorError> {
    let mut s = Vec::new();
    let mut i = start + 1;
    loop {
        match b.get(i) {
            None => return err(start, "unterminated string literal"),
            Some(b'\'') if b.get(i + 1) == Some(&b'\'') => {
                s.push(b'\'');
                i += 2;
            }
            Some(b'\'') => {
                i += 1;
                break;
            }
            Some(&x) => {
                s.push(x);
                i += 1;
            }
        }
    }
    // the input is a &str and quotes are ASCII, so this is valid UTF-8
    let s = String::from_utf8(s).or_else(|_| err(start, "invalid UTF-8"))?;
    Ok((Tok::Str(s), i - start))
}

/// A keyword or identifier starting at `i`: returns the token and its length in bytes.
fn word(text: &str, i: usize) -> Result<(Tok, usize), SelectorError> {
    let ch = text
        .get(i..)
        .and_then(|r| r.chars().next())
        .unwrap_or('\u{fffd}');
    if !(ch.is_alphabetic() || ch == '_' || ch == '$') {
        return err(i, format!("unexpected character '{ch}'"));
    }
    let rest = text.get(i..).unwrap_or("");
    let len = rest
        .char_indices()
        .find(|(_, c)| !(c.is_alphanumeric() || *c == '_' || *c == '$'))
        .map(|(k, _)| k)
        .unwrap_or(rest.len());
    let word = rest.get(..len).unwrap_or("");
    let tok = match keyword(word) {
        Some(k) => Tok::Kw(k),
        None => Tok::Ident(word.to_string()),
    };
    Ok((tok, len))
}

/// A numeric literal at `i`: returns the token and its length in bytes.
fn number(text: &str, i: usize) -> Result<(Tok, usize), SelectorError> {
    let rest = text.get(i..).unwrap_or("");
    let b = rest.as_bytes();
    if b.len() > 2 && b.first() == Some(&b'0') && matches!(b.get(1), Some(b'x' | b'X')) {
        let hex_len = b
            .iter()
            .skip(2)
            .take_while(|c| c.is_ascii_hexdigit())
            .count();
        let digits = rest.get(2..2 + hex_len).unwrap_or("");
        let mut n = 2 + hex_len;
        if matches!(b.get(n), Some(b'l' | b'L')) {
            n += 1;
        }
        return match i64::from_str_radix(digits, 16) {
            Ok(v) => Ok((Tok::Int(v), n)),
            Err(_) => err(i, "invalid hexadecimal number"),
        };
    }
    let mut n = b.iter().take_while(|c| c.is_ascii_digit()).count();
    let mut float = false;
    if b.get(n) == Some(&b'.') {
        float = true;
        n += 1;
        n += b.iter().skip(n).take_while(|c| c.is_ascii_digit()).count();
    }
    if matches!(b.get(n), Some(b'e' | b'E')) {
        let mut k = n + 1;
        if matches!(b.get(k), Some(b'+' | b'-')) {
            k += 1;
        }
        let exp = b.iter().skip(k).take_while(|c| c.is_ascii_digit()).count();
        if exp == 0 {
            return err(i, "a number's exponent has no digits");
        }
        float = true;
        n = k + exp;
    }
    let lit = rest.get(..n).unwrap_or("");
    if lit == "." {
        return err(i, "unexpected character '.'");
    }
    let tok = if float {
        if matches!(b.get(n), Some(b'f' | b'F' | b'd' | b'D')) {
            n += 1;
        }
        Tok::Float(lit.parse().or_else(|_| err(i, "invalid number"))?)
    } else {
        if matches!(b.get(n), Some(b'l' | b'L')) {
            n += 1;
        }
        Tok::Int(
            lit.parse()
                .or_else(|_| err(i, "integer out of range (64-bit)"))?,
        )
    };
    if b.get(n)
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
    {
        return err(i + n, "invalid number");
    }
    Ok((tok, n))
}

// --------------------------------------------------------------------------- parser

struct Parser {
    toks: Vec<(usize, Tok)>,
    i: usize,
    depth: usize,
    end: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.i).map(|(_, t)| t)
    }
    fn pos(&self) -> usize {
        self.toks.get(self.i).map(|(p, _)| *p).unwrap_or(self.end)
    }
    fn eat_kw(&mut self, k: Kw) -> bool {
        if self.peek() == Some(&Tok::Kw(k)) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn eat_op(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Op(o)) if *o == op) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn unexpected<T>(&self, wanted: &str) -> Result<T, SelectorError> {
        match self.peek() {
            Some(t) => err(self.pos(), format!("expected {wanted}, found {t}")),
            None => err(self.pos(), format!("expected {wanted}, found the end")),
        }
    }
    fn enter(&mut self) -> Result<(), SelectorError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return err(self.pos(), format!("nested deeper than {MAX_DEPTH} levels"));
        }
        Ok(())
    }

    /// `e`, a node just built from already-checked children, if the tree under it is no
    /// more than [`MAX_DEPTH`] operators high. [`enter`](Self::enter) bounds the parser's
    /// own recursion, but not the tree's height: parentheses reset its count, so
    /// `((1+1+…)+1+…)` chains many levels under one count. Evaluation recurses over the
    /// tree per message, so the bound must be on the tree. Each child is at most
    /// `MAX_DEPTH` high (checked when it was built), so this costs at most its size.
    fn node(&self, e: Expr) -> Result<Expr, SelectorError> {
        if height(&e) > MAX_DEPTH {
            return err(self.pos(), format!("nested deeper than {MAX_DEPTH} levels"));
        }
        Ok(e)
    }

    fn or(&mut self) -> Result<Expr, SelectorError> {
        self.enter()?;
        let mut e = self.and()?;
        while self.eat_kw(Kw::Or) {
            self.enter()?;
            let r = self.and()?;
            e = self.node(Expr::Or(Box::new(e), Box::new(r)))?;
        }
        self.depth = self.depth.saturating_sub(1);
        Ok(e)
    }

    fn and(&mut self) -> Result<Expr, SelectorError> {
        let mut e = self.not()?;
        while self.eat_kw(Kw::And) {
            self.enter()?;
            let r = self.not()?;
            e = self.node(Expr::And(Box::new(e), Box::new(r)))?;
        }
        Ok(e)
    }

    fn not(&mut self) -> Result<Expr, SelectorError> {
        if self.eat_kw(Kw::Not) {
            self.enter()?;
            let e = self.not()?;
            self.depth -= 1;
            return self.node(Expr::Not(Box::new(e)));
        }
        self.predicate()
    }

    fn predicate(&mut self) -> Result<Expr, SelectorError> {
        let e = self.sum()?;
        let cmp = match self.peek() {
            Some(Tok::Op("=")) => Some(Cmp::Eq),
            Some(Tok::Op("<>")) => Some(Cmp::Ne),
            Some(Tok::Op("<")) => Some(Cmp::Lt),
            Some(Tok::Op("<=")) => Some(Cmp::Le),
            Some(Tok::Op(">")) => Some(Cmp::Gt),
            Some(Tok::Op(">=")) => Some(Cmp::Ge),
            _ => None,
        };
        if let Some(c) = cmp {
            self.i += 1;
            let r = self.sum()?;
            return self.node(Expr::Cmp(c, Box::new(e), Box::new(r)));
        }
        if self.eat_kw(Kw::Is) {
            let not = self.eat_kw(Kw::Not);
            if !self.eat_kw(Kw::Null) {
                return self.unexpected("NULL after IS");
            }
            return self.node(Expr::IsNull {
                not,
                e: Box::new(e),
            });
        }
        let not = self.eat_kw(Kw::Not);
        if self.eat_kw(Kw::Between) {
            let lo = self.sum()?;
            if !self.eat_kw(Kw::And) {
                return self.unexpected("AND in BETWEEN");
            }
            let hi = self.sum()?;
            return self.node(Expr::Between {
                not,
                e: Box::new(e),
                lo: Box::new(lo),
                hi: Box::new(hi),
            });
        }
        if self.eat_kw(Kw::In) {
            return self.in_list(not, e);
        }
        if self.eat_kw(Kw::Like) {
            return self.like(not, e);
        }
        if not {
            return self.unexpected("BETWEEN, IN or LIKE after NOT");
        }
        Ok(e)
    }

    fn in_list(&mut self, not: bool, e: Expr) -> Result<Expr, SelectorError> {
        if self.peek() != Some(&Tok::LParen) {
            return self.unexpected("'(' after IN");
        }
        self.i += 1;
        let mut list = Vec::new();
        loop {
            if list.len() >= MAX_IN {
                return err(
                    self.pos(),
                    format!("an IN list has more than {MAX_IN} items"),
                );
            }
            let neg = self.eat_op("-");
            let v = match (self.peek(), neg) {
                (Some(Tok::Str(s)), false) => Value::Str(s.clone()),
                (Some(Tok::Int(n)), _) => Value::Int(if neg { n.wrapping_neg() } else { *n }),
                (Some(Tok::Float(f)), _) => Value::Float(if neg { -f } else { *f }),
                _ => return self.unexpected("a string or number literal in the IN list"),
            };
            self.i += 1;
            list.push(v);
            match self.peek() {
                Some(Tok::Comma) => self.i += 1,
                Some(Tok::RParen) => {
                    self.i += 1;
                    break;
                }
                _ => return self.unexpected("',' or ')' in the IN list"),
            }
        }
        self.node(Expr::In {
            not,
            e: Box::new(e),
            list,
        })
    }

    fn like(&mut self, not: bool, e: Expr) -> Result<Expr, SelectorError> {
        let pat_pos = self.pos();
        let Some(Tok::Str(pattern)) = self.peek().cloned() else {
            return self.unexpected("a string pattern after LIKE");
        };
        self.i += 1;
        let mut escape = None;
        if self.eat_kw(Kw::Escape) {
            let esc_pos = self.pos();
            let Some(Tok::Str(s)) = self.peek().cloned() else {
                return self.unexpected("a one-character string after ESCAPE");
            };
            let mut cs = s.chars();
            match (cs.next(), cs.next()) {
                (Some(c), None) => escape = Some(c),
                _ => return err(esc_pos, "ESCAPE takes exactly one character"),
            }
            self.i += 1;
        }
        let mut pat = Vec::new();
        let mut chars = pattern.chars();
        while let Some(c) = chars.next() {
            if Some(c) == escape {
                match chars.next() {
                    Some(n) => pat.push(Pat::Lit(n)),
                    None => return err(pat_pos, "the LIKE pattern ends with its escape"),
                }
            } else if c == '%' {
                if pat.last() != Some(&Pat::Any) {
                    pat.push(Pat::Any);
                }
            } else if c == '_' {
                pat.push(Pat::One);
            } else {
                pat.push(Pat::Lit(c));
            }
        }
        self.node(Expr::Like {
            not,
            e: Box::new(e),
            pat,
        })
    }

    fn sum(&mut self) -> Result<Expr, SelectorError> {
        let mut e = self.product()?;
        loop {
            let op = if self.eat_op("+") {
                Arith::Add
            } else if self.eat_op("-") {
                Arith::Sub
            } else {
                return Ok(e);
            };
            self.enter()?;
            let r = self.product()?;
            e = self.node(Expr::Arith(op, Box::new(e), Box::new(r)))?;
        }
    }

    fn product(&mut self) -> Result<Expr, SelectorError> {
        let mut e = self.unary()?;
        loop {
            let op = if self.eat_op("*") {
                Arith::Mul
            } else if self.eat_op("/") {
                Arith::Div
            } else if self.eat_op("%") {
                Arith::Rem
            } else {
                return Ok(e);
            };
            self.enter()?;
            let r = self.unary()?;
            e = self.node(Expr::Arith(op, Box::new(e), Box::new(r)))?;
        }
    }

    fn unary(&mut self) -> Result<Expr, SelectorError> {
        if self.eat_op("-") {
            self.enter()?;
            // -9223372036854775808 is a literal, not the negation of one out of range
            let e = self.unary()?;
            self.depth -= 1;
            return match e {
                Expr::Lit(Value::Int(n)) => Ok(Expr::Lit(Value::Int(n.wrapping_neg()))),
                Expr::Lit(Value::Float(f)) => Ok(Expr::Lit(Value::Float(-f))),
                e => self.node(Expr::Neg(Box::new(e))),
            };
        }
        if self.eat_op("+") {
            self.enter()?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(e);
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, SelectorError> {
        let Some(t) = self.peek().cloned() else {
            return self.unexpected("a value");
        };
        let e = match t {
            Tok::Str(s) => Expr::Lit(Value::Str(s)),
            Tok::Int(n) => Expr::Lit(Value::Int(n)),
            Tok::Float(f) => Expr::Lit(Value::Float(f)),
            Tok::Kw(Kw::True) => Expr::Lit(Value::Bool(true)),
            Tok::Kw(Kw::False) => Expr::Lit(Value::Bool(false)),
            Tok::Ident(s) => Expr::Ident(s),
            Tok::LParen => {
                self.i += 1;
                let depth = self.depth;
                let e = self.or()?;
                self.depth = depth;
                if self.peek() != Some(&Tok::RParen) {
                    return self.unexpected("')'");
                }
                self.i += 1;
                return Ok(e);
            }
            _ => return self.unexpected("a value"),
        };
        self.i += 1;
        Ok(e)
    }
}

/// Operators on the longest path from `e` down to a literal or identifier.
fn height(e: &Expr) -> usize {
    match e {
        Expr::Lit(_) | Expr::Ident(_) => 0,
        Expr::Neg(x)
        | Expr::Not(x)
        | Expr::In { e: x, .. }
        | Expr::Like { e: x, .. }
        | Expr::IsNull { e: x, .. } => 1 + height(x),
        Expr::Arith(_, x, y) | Expr::Cmp(_, x, y) | Expr::And(x, y) | Expr::Or(x, y) => {
            1 + height(x).max(height(y))
        }
        Expr::Between { e, lo, hi, .. } => 1 + height(e).max(height(lo)).max(height(hi)),
    }
}

// ------------------------------------------------------------------------ evaluator

fn truth(v: Option<&Value>) -> Option<bool> {
    match v {
        Some(Value::Bool(b)) => Some(*b),
        // a non-boolean result (`WHERE 1`): not selected, as ActiveMQ
        Some(_) => Some(false),
        None => None,
    }
}

/// A number, reading a numeric string as one (see the module's notes).
fn numeric(v: &Value) -> Option<Value> {
    match v {
        Value::Int(_) | Value::Float(_) => Some(v.clone()),
        Value::Str(s) => {
            let s = s.trim();
            if let Ok(n) = s.parse::<i64>() {
                Some(Value::Int(n))
            } else {
                s.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite())
                    .map(Value::Float)
            }
        }
        Value::Bool(_) => None,
    }
}

fn as_f64(v: &Value) -> f64 {
    match v {
        Value::Int(n) => *n as f64,
        Value::Float(f) => *f,
        _ => f64::NAN,
    }
}

fn arith(op: Arith, a: &Value, b: &Value) -> Option<Value> {
    let (a, b) = (numeric(a)?, numeric(b)?);
    if let (Value::Int(x), Value::Int(y)) = (&a, &b) {
        let (x, y) = (*x, *y);
        return match op {
            Arith::Add => x.checked_add(y),
            Arith::Sub => x.checked_sub(y),
            Arith::Mul => x.checked_mul(y),
            Arith::Div => x.checked_div(y),
            Arith::Rem => x.checked_rem(y),
        }
        .map(Value::Int);
    }
    let (x, y) = (as_f64(&a), as_f64(&b));
    let r = match op {
        Arith::Add => x + y,
        Arith::Sub => x - y,
        Arith::Mul => x * y,
        Arith::Div => x / y,
        Arith::Rem => x % y,
    };
    r.is_finite().then_some(Value::Float(r))
}

/// `a op b` for two non-NULL values: `None` is unknown.
fn compare(op: Cmp, a: &Value, b: &Value) -> Option<bool> {
    use std::cmp::Ordering;
    let ord: Ordering = match (a, b) {
        (Value::Str(x), Value::Str(y)) => {
            return match op {
                Cmp::Eq => Some(x == y),
                Cmp::Ne => Some(x != y),
                _ => Some(false),
            }
        }
        (Value::Bool(x), Value::Bool(y)) => {
            return match op {
                Cmp::Eq => Some(x == y),
                Cmp::Ne => Some(x != y),
                _ => Some(false),
            }
        }
        (Value::Bool(_), _) | (_, Value::Bool(_)) => return Some(false),
        _ => {
            let (Some(x), Some(y)) = (numeric(a), numeric(b)) else {
                return Some(false);
            };
            match (&x, &y) {
                (Value::Int(i), Value::Int(j)) => i.cmp(j),
                _ => as_f64(&x).partial_cmp(&as_f64(&y))?,
            }
        }
    };
    Some(match op {
        Cmp::Eq => ord == Ordering::Equal,
        Cmp::Ne => ord != Ordering::Equal,
        Cmp::Lt => ord == Ordering::Less,
        Cmp::Le => ord != Ordering::Greater,
        Cmp::Gt => ord == Ordering::Greater,
        Cmp::Ge => ord != Ordering::Less,
    })
}

fn not3(v: Option<bool>) -> Option<bool> {
    v.map(|b| !b)
}

fn and3(a: Option<bool>, b: impl FnOnce() -> Option<bool>) -> Option<bool> {
    if a == Some(false) {
        return Some(false);
    }
    match (a, b()) {
        (_, Some(false)) => Some(false),
        (Some(true), Some(true)) => Some(true),
        _ => None,
    }
}

fn or3(a: Option<bool>, b: impl FnOnce() -> Option<bool>) -> Option<bool> {
    if a == Some(true) {
        return Some(true);
    }
    match (a, b()) {
        (_, Some(true)) => Some(true),
        (Some(false), Some(false)) => Some(false),
        _ => None,
    }
}

fn like(pat: &[Pat], s: &str) -> bool {
    // the iterative wildcard match: backtrack only to the last `%`, so it is
    // O(pattern × value) at worst, never exponential. `i` is a byte offset on a char
    // boundary: no copy of the value per message
    let at = |i: usize| s.get(i..).and_then(|r| r.chars().next());
    let (mut p, mut i) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while let Some(ch) = at(i) {
        match pat.get(p) {
            Some(Pat::Any) => {
                star = Some((p, i));
                p += 1;
            }
            Some(Pat::One) => {
                p += 1;
                i += ch.len_utf8();
            }
            Some(Pat::Lit(c)) if *c == ch => {
                p += 1;
                i += ch.len_utf8();
            }
            _ => match star {
                Some((sp, si)) => {
                    // one more character under the `%`
                    let next = si + at(si).map_or(1, char::len_utf8);
                    p = sp + 1;
                    i = next;
                    star = Some((sp, next));
                }
                None => return false,
            },
        }
    }
    pat.iter().skip(p).all(|x| *x == Pat::Any)
}

/// An expression's value: a literal borrowed from the tree (no copy per message), the rest
/// computed.
fn eval<'e>(e: &'e Expr, f: &dyn Fields) -> Option<Cow<'e, Value>> {
    let b = |x: Option<bool>| x.map(|v| Cow::Owned(Value::Bool(v)));
    match e {
        Expr::Lit(v) => Some(Cow::Borrowed(v)),
        Expr::Ident(name) => f.field(name).map(Cow::Owned),
        Expr::Neg(x) => match numeric(&*eval(x, f)?)? {
            Value::Int(n) => n.checked_neg().map(Value::Int),
            Value::Float(v) => Some(Value::Float(-v)),
            _ => None,
        }
        .map(Cow::Owned),
        Expr::Arith(op, x, y) => arith(*op, &*eval(x, f)?, &*eval(y, f)?).map(Cow::Owned),
        Expr::Cmp(op, x, y) => b(compare(*op, &*eval(x, f)?, &*eval(y, f)?)),
        Expr::Between { not, e, lo, hi } => {
            let v = eval(e, f);
            let ge = match (&v, eval(lo, f)) {
                (Some(v), Some(l)) => compare(Cmp::Ge, v, &l),
                _ => None,
            };
            let r = and3(ge, || match (&v, eval(hi, f)) {
                (Some(v), Some(h)) => compare(Cmp::Le, v, &h),
                _ => None,
            });
            b(if *not { not3(r) } else { r })
        }
        Expr::In { not, e, list } => {
            let v = eval(e, f)?;
            let found = list
                .iter()
                .any(|item| compare(Cmp::Eq, &v, item) == Some(true));
            b(Some(found != *not))
        }
        Expr::Like { not, e, pat } => match &*eval(e, f)? {
            Value::Str(s) => b(Some(like(pat, s) != *not)),
            _ => b(Some(false)),
        },
        Expr::IsNull { not, e } => b(Some(eval(e, f).is_none() != *not)),
        Expr::Not(x) => b(not3(truth(eval(x, f).as_deref()))),
        Expr::And(x, y) => b(and3(truth(eval(x, f).as_deref()), || {
            truth(eval(y, f).as_deref())
        })),
        Expr::Or(x, y) => b(or3(truth(eval(x, f).as_deref()), || {
            truth(eval(y, f).as_deref())
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Map(HashMap<&'static str, Value>);
    impl Fields for Map {
        fn field(&self, name: &str) -> Option<Value> {
            self.0.get(name).cloned()
        }
    }

    fn msg() -> Map {
        Map(HashMap::from([
            ("color", Value::Str("red".into())),
            ("weight", Value::Int(12)),
            ("price", Value::Float(2.5)),
            ("size", Value::Str("42".into())),
            ("urgent", Value::Bool(true)),
            ("name", Value::Str("ab_c%d".into())),
        ]))
    }

    fn eval3(s: &str) -> Option<bool> {
        Selector::parse(s)
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .evaluate(&msg())
    }

    #[test]
    fn comparisons_and_arithmetic() {
        for (s, want) in [
            ("color = 'red'", Some(true)),
            ("color <> 'red'", Some(false)),
            ("weight > 10", Some(true)),
            ("weight >= 12 AND weight <= 12", Some(true)),
            ("weight < 12.5", Some(true)),
            ("price * 2 = 5", Some(true)),
            ("weight / 5 = 2", Some(true)),
            ("weight % 5 = 2", Some(true)),
            ("-weight + 20 = 8", Some(true)),
            ("weight - 2 * 3 = 6", Some(true)),
            ("(weight - 2) * 3 = 30", Some(true)),
            ("1e1 < weight", Some(true)),
            ("0x0C = weight", Some(true)),
            ("12L = weight", Some(true)),
            ("urgent = TRUE", Some(true)),
            ("urgent", Some(true)),
            ("NOT urgent", Some(false)),
            // strings order only with = and <>; unlike types are false
            ("color < 's'", Some(false)),
            ("color = 1", Some(false)),
            ("urgent = 1", Some(false)),
            // a numeric string reads as a number against a number (STOMP headers)
            ("size > 40", Some(true)),
            ("size + 1 = 43", Some(true)),
            ("size = '42'", Some(true)),
            ("weight / 0 = 1", None),
            ("9223372036854775807 + weight > 0", None),
        ] {
            assert_eq!(eval3(s), want, "{s}");
        }
    }

    #[test]
    fn three_valued_logic() {
        for (s, want) in [
            ("missing = 1", None),
            ("missing > 1 OR weight = 12", Some(true)),
            ("missing > 1 OR weight = 13", None),
            ("missing > 1 AND weight = 13", Some(false)),
            ("missing > 1 AND weight = 12", None),
            ("NOT (missing > 1)", None),
            ("missing IS NULL", Some(true)),
            ("missing IS NOT NULL", Some(false)),
            ("color IS NOT NULL", Some(true)),
            ("missing IN ('a')", None),
            ("missing NOT IN ('a')", None),
            ("missing LIKE 'a%'", None),
            ("missing BETWEEN 1 AND 2", None),
            ("weight BETWEEN missing AND 2", Some(false)),
            ("weight BETWEEN missing AND 20", None),
        ] {
            assert_eq!(eval3(s), want, "{s}");
        }
        assert!(!Selector::parse("missing = 1").unwrap().matches(&msg()));
    }

    #[test]
    fn between_in_like() {
        for (s, want) in [
            ("weight BETWEEN 10 AND 12", Some(true)),
            ("weight NOT BETWEEN 10 AND 12", Some(false)),
            ("price BETWEEN 2 AND 3", Some(true)),
            ("color IN ('blue', 'red')", Some(true)),
            ("color NOT IN ('blue', 'red')", Some(false)),
            ("weight IN (1, 12, -3)", Some(true)),
            ("color LIKE 'r%'", Some(true)),
            ("color LIKE '_e_'", Some(true)),
            ("color LIKE 'r_'", Some(false)),
            ("color NOT LIKE '%x%'", Some(true)),
            ("name LIKE 'ab\\_c\\%d' ESCAPE '\\'", Some(true)),
            ("name LIKE 'ab!_c!%%' ESCAPE '!'", Some(true)),
            ("name LIKE 'abxc%' ESCAPE '!'", Some(false)),
            ("name LIKE '%%%%_'", Some(true)),
            ("weight LIKE '1%'", Some(false)),
        ] {
            assert_eq!(eval3(s), want, "{s}");
        }
    }

    #[test]
    fn keywords_are_case_insensitive_and_strings_escape_quotes() {
        let m = Map(HashMap::from([("s", Value::Str("it's".into()))]));
        let sel = Selector::parse("s = 'it''s' and NoT s is null").unwrap();
        assert!(sel.matches(&m));
    }

    #[test]
    fn malformed_selectors_name_the_problem() {
        for (s, frag) in [
            ("", "expected a value, found the end"),
            ("color =", "expected a value"),
            ("color = 'red", "unterminated string"),
            ("color == 'red'", "expected a value, found '='"),
            ("weight BETWEEN 1 OR 2", "AND in BETWEEN"),
            ("color IN 'a'", "'(' after IN"),
            ("color IN (a)", "literal in the IN list"),
            ("color LIKE 5", "string pattern after LIKE"),
            ("color LIKE 'a' ESCAPE 'ab'", "exactly one character"),
            ("color IS 5", "NULL after IS"),
            ("color NOT 5", "BETWEEN, IN or LIKE after NOT"),
            ("(color = 'a'", "expected ')'"),
            ("color = 'a')", "unexpected ')'"),
            ("color # 1", "unexpected character '#'"),
            ("99999999999999999999 = 1", "out of range"),
            ("1e = 1", "exponent"),
            ("12abc = 1", "invalid number"),
        ] {
            let e = Selector::parse(s).expect_err(s);
            assert!(e.to_string().contains(frag), "{s}: {e}");
        }
    }

    #[test]
    fn like_matches_characters_not_bytes() {
        let m = Map(HashMap::from([("s", Value::Str("héllo 日本語".into()))]));
        for (pat, want) in [
            ("h_llo%", true),
            ("%_本_", true),
            ("%語", true),
            ("h%l_o ___", true),
            ("h_llo ____", false),
            ("%本", false),
            ("_éllo%", true),
            ("__llo%", true),
            ("___llo%", false),
        ] {
            let sel = Selector::parse(&format!("s LIKE '{pat}'")).unwrap();
            assert_eq!(sel.matches(&m), want, "{pat}");
        }
    }

    #[test]
    fn hostile_input_is_bounded() {
        let long = format!("a = '{}'", "x".repeat(MAX_LEN));
        assert!(Selector::parse(&long)
            .unwrap_err()
            .msg
            .contains("longer than"));
        let deep = format!("{}a = 1{}", "(".repeat(1000), ")".repeat(1000));
        assert!(Selector::parse(&deep).unwrap_err().msg.contains("nested"));
        let nots = format!("{} a = 1", "NOT ".repeat(500));
        assert!(Selector::parse(&nots).unwrap_err().msg.contains("nested"));
        let negs = format!("a = {}1", "-".repeat(500));
        assert!(Selector::parse(&negs).unwrap_err().msg.contains("nested"));
        let sums = format!("a = 1{}", " + 1".repeat(500));
        assert!(Selector::parse(&sums).unwrap_err().msg.contains("nested"));
        let ors = format!("a = 1{}", " OR a = 1".repeat(200));
        assert!(Selector::parse(&ors).unwrap_err().msg.contains("nested"));
        let items: Vec<String> = (0..=MAX_IN).map(|i| i.to_string()).collect();
        let big_in = format!("a IN ({})", items.join(","));
        assert!(Selector::parse(&big_in)
            .unwrap_err()
            .msg
            .contains("IN list"));
        // just inside the bounds
        let items: Vec<String> = (0..MAX_IN).map(|i| i.to_string()).collect();
        assert!(Selector::parse(&format!("weight IN ({})", items.join(",")))
            .unwrap()
            .matches(&msg()));
        // parentheses reset the parser's count: each level below holds a chain of 55
        // additions, ~1,900 levels of tree in under 4 KiB; refused, not built
        let chain = format!(
            "a = {}1{}",
            "(".repeat(35),
            ("+1".repeat(55) + ")").repeat(35)
        );
        assert!(chain.len() <= MAX_LEN);
        let e = Selector::parse(&chain).unwrap_err();
        assert!(e.msg.contains("nested"), "{e}");
        let ands = format!(
            "{}a = 1{}",
            "(".repeat(35),
            (" AND a = 1".repeat(5) + ")").repeat(35)
        );
        assert!(Selector::parse(&ands).unwrap_err().msg.contains("nested"));
        let ok = format!("{}weight = 12{}", "(".repeat(30), ")".repeat(30));
        assert!(Selector::parse(&ok).unwrap().matches(&msg()));
        // the tallest tree accepted evaluates on a small stack (the fuzz target's)
        let tall = format!("weight = 12{}", " + 0".repeat(MAX_DEPTH - 1));
        let sel = Selector::parse(&tall).unwrap();
        let ok = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || sel.matches(&msg()))
            .unwrap()
            .join()
            .unwrap();
        assert!(ok);
        // a pattern that is exponential for a naive backtracking matcher
        let m = Map(HashMap::from([("s", Value::Str("a".repeat(3000)))]));
        let sel = Selector::parse(&format!("s LIKE '{}b'", "%a".repeat(500))).unwrap();
        assert!(!sel.matches(&m));
    }
}

//! CPU kernels of ops/elementwise.rs.

use num_traits::{AsPrimitive, Float, Num};

use super::broadcast::{map1, map2, map3};
use super::tensor_view::{Elem, In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Numeric element types.
pub trait Arith: Elem + Num + PartialOrd + AsPrimitive<f64> {}
impl<T: Elem + Num + PartialOrd + AsPrimitive<f64>> Arith for T {}

/// Float element types with the math kernels need beyond num_traits.
pub trait FloatElem: Arith + Float + AsPrimitive<f64> {
    fn erf(self) -> Self;
    fn from_f64(v: f64) -> Self;
}
impl FloatElem for f32 {
    fn erf(self) -> Self {
        libm::erff(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl FloatElem for f64 {
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

pub(super) fn ab<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>]) -> Result<(&'b In<'a>, &'b In<'a>)> {
    let a = inputs.first().and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 0 missing"))?;
    let b = inputs.get(1).and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 1 missing"))?;
    Ok((a, b))
}

pub(super) fn first<'a, 'b>(node: &Node, inputs: &'b [Option<In<'a>>]) -> Result<&'b In<'a>> {
    inputs.first().and_then(|x| x.as_ref()).ok_or_else(|| node.err("input 0 missing"))
}

macro_rules! binary_num {
    ($name:ident, |$x:ident, $y:ident| $e:expr) => {
        fn $name(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
            fn go<T: Arith>(a: &In, b: &In, o: &mut Out) -> Result<()> {
                map2::<T, T, T>(a, b, o, |$x, $y| $e)
            }
            let (a, b) = ab(node, inputs)?;
            crate::dispatch_num!(a.dtype, node, go::<T>(a, b, &mut out[0]))
        }
    };
}
binary_num!(add, |x, y| x + y);
binary_num!(sub, |x, y| x - y);
binary_num!(mul, |x, y| x * y);
binary_num!(div, |x, y| x / y);
binary_num!(max, |x, y| if y > x || y.partial_cmp(&y).is_none() { y } else { x }); // NaN propagates
binary_num!(min, |x, y| if y < x || y.partial_cmp(&y).is_none() { y } else { x });

/// MinMaxGrad(dy, a, b): dy where input `which` won, dy/2 on ties, 0 elsewhere (shaped like dy).
fn min_max_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let (a, b) = ab(node, &inputs[1..])?;
    let is_max = node.attrs.int("is_max", 1).map_err(|e| node.err(e.to_string()))? != 0;
    let which = node.attrs.int("which", 0).map_err(|e| node.err(e.to_string()))?;
    fn go<T: FloatElem>(dy: &In, a: &In, b: &In, o: &mut Out, is_max: bool, which: i64) -> Result<()> {
        let half = T::from_f64(0.5);
        map3::<T, T, T, T>(dy, a, b, o, move |d, x, y| {
            let (mine, other) = if which == 0 { (x, y) } else { (y, x) };
            if mine == other {
                d * half
            } else if (mine > other) == is_max {
                d
            } else {
                T::zero()
            }
        })
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, a, b, &mut out[0], is_max, which))
}

fn div_checked(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let (a, b) = ab(node, inputs)?;
    if b.dtype.is_float() {
        return div(node, inputs, out, ctx);
    }
    // integers: a zero divisor is an error; MIN / -1 wraps instead of trapping
    fn int<T: Arith + num_traits::CheckedDiv + num_traits::WrappingNeg>(node: &Node, a: &In, b: &In, o: &mut Out) -> Result<()> {
        if b.slice::<T>()?.contains(&T::zero()) {
            return Err(node.err("integer division by zero"));
        }
        map2::<T, T, T>(a, b, o, |x, y| x.checked_div(&y).unwrap_or_else(|| x.wrapping_neg()))
    }
    match a.dtype {
        DType::I64 => int::<i64>(node, a, b, &mut out[0]),
        DType::I32 => int::<i32>(node, a, b, &mut out[0]),
        DType::I8 => int::<i8>(node, a, b, &mut out[0]),
        DType::U8 | DType::Bool => int::<u8>(node, a, b, &mut out[0]),
        d => Err(node.err(format!("Div of {} is not supported", d.name()))),
    }
}

fn variadic_check(node: &Node, inputs: &[Option<In>]) -> Result<()> {
    if inputs.len() != 2 {
        return Err(node.err(format!("{} with {} inputs is not supported yet (2 only)", node.op_type, inputs.len())));
    }
    Ok(())
}

fn max2(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    variadic_check(node, inputs)?;
    max(node, inputs, out, ctx)
}
fn min2(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    variadic_check(node, inputs)?;
    min(node, inputs, out, ctx)
}

fn pow(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    fn go<T: FloatElem, E: Arith>(a: &In, b: &In, o: &mut Out) -> Result<()> {
        map2::<T, E, T>(a, b, o, |x, y| {
            let e: f64 = y.as_();
            if e == 2.0 {
                x * x
            } else if e == e.trunc() && e.abs() < 64.0 {
                x.powi(e as i32)
            } else {
                x.powf(T::from_f64(e))
            }
        })
    }
    let (a, b) = ab(node, inputs)?;
    match (a.dtype, b.dtype) {
        (DType::F32, DType::F32) => go::<f32, f32>(a, b, &mut out[0]),
        (DType::F32, DType::I64) => go::<f32, i64>(a, b, &mut out[0]),
        (DType::F32, DType::I32) => go::<f32, i32>(a, b, &mut out[0]),
        (DType::F32, DType::F64) => go::<f32, f64>(a, b, &mut out[0]),
        (DType::F64, DType::F64) => go::<f64, f64>(a, b, &mut out[0]),
        (DType::F64, DType::F32) => go::<f64, f32>(a, b, &mut out[0]),
        (DType::F64, DType::I64) => go::<f64, i64>(a, b, &mut out[0]),
        (DType::I64, DType::I64) => map2::<i64, i64, i64>(a, b, &mut out[0], |x, y| if y < 0 { 0 } else { x.wrapping_pow(y as u32) }),
        (x, y) => Err(node.err(format!("Pow of {} by {} is not supported", x.name(), y.name()))),
    }
}

fn modulo(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let fmod = node.attrs.int("fmod", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let (a, b) = ab(node, inputs)?;
    fn int<T: Arith + num_traits::CheckedRem>(a: &In, b: &In, o: &mut Out, fmod: bool) -> Result<()> {
        map2::<T, T, T>(a, b, o, move |x, y| {
            // a zero divisor gives 0, and MIN % -1 (which overflows) is 0 as well
            let Some(r) = x.checked_rem(&y) else { return T::zero() };
            // Python-style: the result takes the divisor's sign
            if !fmod && r != T::zero() && ((r < T::zero()) != (y < T::zero())) {
                r + y
            } else {
                r
            }
        })
    }
    // floats: no zero-divisor guard, x % ±0 is NaN (Mod-28's special cases follow from % and
    // the sign fix-up, ±inf included)
    fn float<T: Arith + std::ops::Rem<Output = T>>(a: &In, b: &In, o: &mut Out, fmod: bool) -> Result<()> {
        map2::<T, T, T>(a, b, o, move |x, y| {
            let r = x % y;
            if !fmod && r != T::zero() && ((r < T::zero()) != (y < T::zero())) {
                r + y
            } else {
                r
            }
        })
    }
    match a.dtype {
        DType::I64 => int::<i64>(a, b, &mut out[0], fmod),
        DType::I32 => int::<i32>(a, b, &mut out[0], fmod),
        DType::I8 => int::<i8>(a, b, &mut out[0], fmod),
        DType::U8 => int::<u8>(a, b, &mut out[0], fmod),
        DType::F32 => float::<f32>(a, b, &mut out[0], fmod),
        DType::F64 => float::<f64>(a, b, &mut out[0], fmod),
        d => Err(node.err(format!("Mod of {} is not supported", d.name()))),
    }
}

macro_rules! compare {
    ($name:ident, |$x:ident, $y:ident| $e:expr) => {
        fn $name(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
            fn go<T: Arith>(a: &In, b: &In, o: &mut Out) -> Result<()> {
                map2::<T, T, u8>(a, b, o, |$x, $y| ($e) as u8)
            }
            let (a, b) = ab(node, inputs)?;
            crate::dispatch_num!(a.dtype, node, go::<T>(a, b, &mut out[0]))
        }
    };
}
compare!(equal, |x, y| x == y);
compare!(less, |x, y| x < y);
compare!(greater, |x, y| x > y);
compare!(less_eq, |x, y| x <= y);
compare!(greater_eq, |x, y| x >= y);

macro_rules! logic {
    ($name:ident, |$x:ident, $y:ident| $e:expr) => {
        fn $name(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
            let (a, b) = ab(node, inputs)?;
            map2::<u8, u8, u8>(a, b, &mut out[0], |$x, $y| ($e) as u8)
        }
    };
}
logic!(and, |x, y| x != 0 && y != 0);
logic!(or, |x, y| x != 0 || y != 0);
logic!(xor, |x, y| (x != 0) != (y != 0));

fn not(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    map1::<u8, u8>(first(node, inputs)?, &mut out[0], |x| (x == 0) as u8)
}

fn where_(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    fn go<T: Elem>(c: &In, a: &In, b: &In, o: &mut Out) -> Result<()> {
        map3::<u8, T, T, T>(c, a, b, o, |c, x, y| if c != 0 { x } else { y })
    }
    let c = first(node, inputs)?;
    let (a, b) = ab(node, &inputs[1..])?;
    crate::dispatch_num!(a.dtype, node, go::<T>(c, a, b, &mut out[0]))
}

fn cast(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let a = first(node, inputs)?;
    let o = &mut out[0];
    if a.dtype == o.dtype {
        o.bytes().copy_from_slice(a.bytes());
        return Ok(());
    }
    fn go<S: Elem + AsPrimitive<D>, D: Elem>(a: &In, o: &mut Out) -> Result<()> {
        map1::<S, D>(a, o, |x| x.as_())
    }
    fn to_bool<S: Arith>(a: &In, o: &mut Out) -> Result<()> {
        map1::<S, u8>(a, o, |x| (x != S::zero()) as u8)
    }
    macro_rules! from {
        ($s:ty) => {
            match o.dtype {
                DType::F32 => go::<$s, f32>(a, o),
                DType::F64 => go::<$s, f64>(a, o),
                DType::I64 => go::<$s, i64>(a, o),
                DType::I32 => go::<$s, i32>(a, o),
                DType::U8 => go::<$s, u8>(a, o),
                DType::I8 => go::<$s, i8>(a, o),
                DType::Bool => to_bool::<$s>(a, o),
                DType::BF16 | DType::F16 => Err(half_reached(node)),
            }
        };
    }
    match a.dtype {
        DType::F32 => from!(f32),
        DType::F64 => from!(f64),
        DType::I64 => from!(i64),
        DType::I32 => from!(i32),
        DType::U8 | DType::Bool => from!(u8),
        DType::I8 => from!(i8),
        DType::BF16 | DType::F16 => Err(half_reached(node)),
    }
}

/// 16-bit floats reach Cast widened to f32 (backend/cpu/widen.rs), never as such.
fn half_reached(node: &Node) -> crate::error::Error {
    node.err("a 16-bit float reached Cast unwidened")
}

macro_rules! unary_float {
    ($name:ident, |$x:ident| $e:expr) => {
        fn $name(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
            fn go<T: FloatElem>(a: &In, o: &mut Out) -> Result<()> {
                map1::<T, T>(a, o, |$x| $e)
            }
            let a = first(node, inputs)?;
            crate::dispatch_float!(a.dtype, node, go::<T>(a, &mut out[0]))
        }
    };
}
unary_float!(sqrt, |x| x.sqrt());
unary_float!(exp, |x| x.exp());
unary_float!(log, |x| x.ln());
unary_float!(sin, |x| x.sin());
unary_float!(cos, |x| x.cos());
unary_float!(erf, |x| x.erf());
unary_float!(recip, |x| x.recip());
unary_float!(floor, |x| x.floor());
unary_float!(ceil, |x| x.ceil());

/// `0 − x` that wraps for integers, as PyTorch does (the minimum value stays, uint8 wraps
/// around), instead of overflowing (a panic in debug builds).
pub trait NegWrapping: Copy {
    fn neg_wrapping(self) -> Self;
}
macro_rules! neg_wrapping {
    (float: $($t:ty),*; int: $($i:ty),*) => {
        $(impl NegWrapping for $t { fn neg_wrapping(self) -> Self { -self } })*
        $(impl NegWrapping for $i { fn neg_wrapping(self) -> Self { self.wrapping_neg() } })*
    };
}
neg_wrapping!(float: f32, f64; int: i64, i32, i8, u8);

macro_rules! unary_num {
    ($name:ident, |$x:ident| $e:expr) => {
        fn $name(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
            fn go<T: Arith + NegWrapping>(a: &In, o: &mut Out) -> Result<()> {
                map1::<T, T>(a, o, |$x| $e)
            }
            let a = first(node, inputs)?;
            crate::dispatch_num!(a.dtype, node, go::<T>(a, &mut out[0]))
        }
    };
}
unary_num!(neg, |x| x.neg_wrapping());
unary_num!(abs, |x| if x < T::zero() { x.neg_wrapping() } else { x });
unary_num!(sign, |x| if x > T::zero() {
    T::one()
} else if x < T::zero() {
    T::zero() - T::one()
} else {
    T::zero()
});

fn is_nan(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    fn go<T: FloatElem>(a: &In, o: &mut Out) -> Result<()> {
        map1::<T, u8>(a, o, |x| x.is_nan() as u8)
    }
    let a = first(node, inputs)?;
    crate::dispatch_float!(a.dtype, node, go::<T>(a, &mut out[0]))
}

fn is_inf(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (pos, neg) = (node.attrs.int("detect_positive", 1).unwrap_or(1) != 0, node.attrs.int("detect_negative", 1).unwrap_or(1) != 0);
    fn go<T: FloatElem>(a: &In, o: &mut Out, pos: bool, neg: bool) -> Result<()> {
        map1::<T, u8>(a, o, move |x| (x.is_infinite() && ((x > T::zero() && pos) || (x < T::zero() && neg))) as u8)
    }
    let a = first(node, inputs)?;
    crate::dispatch_float!(a.dtype, node, go::<T>(a, &mut out[0], pos, neg))
}

pub(super) fn identity(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let a = first(node, inputs)?;
    out[0].bytes().copy_from_slice(a.bytes());
    Ok(())
}

pub fn register(t: &mut KernelTable) {
    t.add("Add", add);
    t.add("Sub", sub);
    t.add("Mul", mul);
    t.add("Div", div_checked);
    t.add("Pow", pow);
    t.add("Mod", modulo);
    t.add("Max", max2);
    t.add("Min", min2);
    t.add("MinMaxGrad", min_max_grad);
    t.add("Equal", equal);
    t.add("Less", less);
    t.add("Greater", greater);
    t.add("LessOrEqual", less_eq);
    t.add("GreaterOrEqual", greater_eq);
    t.add("And", and);
    t.add("Or", or);
    t.add("Xor", xor);
    t.add("Not", not);
    t.add("Where", where_);
    t.add("Cast", cast);
    t.add("CastLike", cast);
    t.add("Sqrt", sqrt);
    t.add("Exp", exp);
    t.add("Log", log);
    t.add("Sin", sin);
    t.add("Cos", cos);
    t.add("Erf", erf);
    t.add("Reciprocal", recip);
    t.add("Floor", floor);
    t.add("Ceil", ceil);
    t.add("Neg", neg);
    t.add("Abs", abs);
    t.add("Sign", sign);
    t.add("IsNaN", is_nan);
    t.add("IsInf", is_inf);
    t.add("Identity", identity);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    #[test]
    fn min_max_grad_splits_ties() {
        // a = [1, 5, 3], b = 3 (broadcast): Max winners a: [no, yes, tie]
        let (dy, a, b) =
            (Tensor::from_f32(vec![3], vec![2., 2., 2.]), Tensor::from_f32(vec![3], vec![1., 5., 3.]), Tensor::from_f32(vec![1], vec![3.]));
        let g = |is_max: i64, which: i64| {
            let attrs = Attrs::default().with("is_max", Attr::Int(is_max)).with("which", Attr::Int(which));
            run("MinMaxGrad", attrs, &[&dy, &a, &b])[0].to_f64_vec()
        };
        assert_eq!(g(1, 0), vec![0., 2., 1.]);
        assert_eq!(g(1, 1), vec![2., 0., 1.]);
        assert_eq!(g(0, 0), vec![2., 0., 1.]);
    }
}

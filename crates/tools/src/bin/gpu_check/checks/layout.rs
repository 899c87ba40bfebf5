//! The `layout` family of checks.

use tpar_kernels::cuda::raw::layout;

use super::Ctx;
use crate::data::{decode_words, encode_words};
use crate::Res;

pub(crate) fn check_layout(c: &mut Ctx) {
    let big = !c.quick;
    let n = if big { (1 << 24) + 3 } else { 1003 };
    for w in [2, 4, 8] {
        copy_case(c, w, n);
    }
    for w in [2, 4] {
        let (rows, cols, sld, dld) = if big { (4096, 4000, 4104, 4096) } else { (7, 13, 20, 16) };
        copy2d_case(c, w, rows, cols, sld, dld);
        let (outer, size, inner, start, len) =
            if big { (64, 1000, 128, 100, 500) } else { (3, 10, 6, 2, 5) };
        let strides = [size * inner, inner, 1];
        gather_case(
            c,
            "narrow",
            w,
            outer * size * inner,
            start * inner,
            &strides,
            &[outer, len, inner],
        );
        let (b, r, k) = if big { (8, 1000, 1030) } else { (2, 33, 45) };
        gather_case(c, "transpose", w, b * r * k, 0, &[r * k, 1, k], &[b, k, r]);
        let shape = if big { [4usize, 2048, 32, 128] } else { [2, 5, 3, 8] };
        permute_case(c, w, &shape, &[0, 2, 1, 3]);
        let (src, out) = if big {
            (vec![32, 1, 128], vec![4, 32, 512, 128])
        } else {
            (vec![3, 1, 5], vec![2, 3, 4, 5])
        };
        expand_case(c, w, &src, &out);
        gather_case(c, "strided_copy", w, 200, 3, &[40, 1, 7], &[4, 5, 3]);
        cat_case(c, w, if big { (64, 300, 700, 128) } else { (3, 4, 7, 5) });
    }
}

/// The CPU reference of every gather: `out[i] = src[base + sum(idx * strides)]`.
pub(crate) fn cpu_gather(
    src: &[u64],
    base: usize,
    strides: &[usize],
    shape: &[usize],
) -> Res<Vec<u64>> {
    let mut out = vec![0u64; shape.iter().product()];
    tpar_kernels::elementwise::strided_copy::<u64, _>(src, base, strides, shape, &mut out)?;
    Ok(out)
}

pub(crate) fn copy_case(c: &mut Ctx, w: usize, n: usize) {
    let dtype = format!("{}-byte", w);
    let shape = format!("n{n}");
    c.guard("copy", &dtype, &shape, |c| {
        let d = c.d;
        let x = c.rng.words(n, w);
        let (bx, by) = (d.bytes(&encode_words(w, &x))?, d.junk(n * w)?);
        // SAFETY: `n` elements of `w` bytes allocated above.
        unsafe { layout::copy(d.l(), w, bx.ptr(), by.ptr(), n)? };
        c.r.exact("layout.copy", &dtype, &shape, &decode_words(w, &by.to_host()?), &x);
        Ok(())
    });
}

pub(crate) fn copy2d_case(c: &mut Ctx, w: usize, rows: usize, cols: usize, sld: usize, dld: usize) {
    let dtype = format!("{}-byte", w);
    let shape = format!("{rows}x{cols} ld {sld}>{dld}");
    c.guard("copy2d", &dtype, &shape, |c| {
        let d = c.d;
        let src = c.rng.words(rows * sld, w);
        let dst0 = c.rng.words(rows * dld, w);
        let rows_out = cpu_gather(&src, 0, &[sld, 1], &[rows, cols])?;
        let mut want = dst0.clone();
        for r in 0..rows {
            want[r * dld..r * dld + cols].copy_from_slice(&rows_out[r * cols..(r + 1) * cols]);
        }
        let (bs, bd) = (d.bytes(&encode_words(w, &src))?, d.bytes(&encode_words(w, &dst0))?);
        // SAFETY: both buffers hold `rows` rows at their pitches.
        unsafe { layout::copy2d(d.l(), w, rows, cols, bs.ptr(), sld, bd.ptr(), dld)? };
        c.r.exact("layout.copy2d", &dtype, &shape, &decode_words(w, &bd.to_host()?), &want);
        Ok(())
    });
}

/// `narrow`, `transpose` and general strided copies through `strided_copy`
/// (which dispatches to the pitched copy, the tiled transpose or the gather).
pub(crate) fn gather_case(
    c: &mut Ctx,
    what: &str,
    w: usize,
    src_len: usize,
    base: usize,
    strides: &[usize],
    shape: &[usize],
) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{shape:?} st {strides:?}+{base}");
    let name = format!("layout.{what}");
    c.guard(&name, &dtype, &sh, |c| {
        let d = c.d;
        let src = c.rng.words(src_len, w);
        let want = cpu_gather(&src, base, strides, shape)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(want.len() * w)?);
        // SAFETY: the source covers every element the strides reach from `base`.
        unsafe { layout::strided_copy(d.l(), w, bs.ptr(), base, strides, shape, bo.ptr())? };
        c.r.exact(&name, &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

pub(crate) fn permute_case(c: &mut Ctx, w: usize, shape: &[usize], perm: &[usize]) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{shape:?} perm {perm:?}");
    c.guard("layout.permute", &dtype, &sh, |c| {
        let d = c.d;
        let n: usize = shape.iter().product();
        let src = c.rng.words(n, w);
        let st = tpar_kernels::elementwise::contiguous_strides(shape);
        let strides: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        let want = cpu_gather(&src, 0, &strides, &out)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(n * w)?);
        // SAFETY: both buffers hold the tensor's `n` elements.
        unsafe { layout::permute(d.l(), w, bs.ptr(), shape, perm, bo.ptr())? };
        c.r.exact("layout.permute", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

pub(crate) fn expand_case(c: &mut Ctx, w: usize, src_shape: &[usize], out: &[usize]) {
    let dtype = format!("{}-byte", w);
    let sh = format!("{src_shape:?}>{out:?}");
    c.guard("layout.expand", &dtype, &sh, |c| {
        let d = c.d;
        let src = c.rng.words(src_shape.iter().product(), w);
        let strides = layout::broadcast_strides("expand", src_shape, out)?;
        let want = cpu_gather(&src, 0, &strides, out)?;
        let (bs, bo) = (d.bytes(&encode_words(w, &src))?, d.junk(want.len() * w)?);
        // SAFETY: the source holds `src_shape`'s elements, the output `out`'s.
        unsafe { layout::expand(d.l(), w, bs.ptr(), src_shape, out, bo.ptr())? };
        c.r.exact("layout.expand", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

pub(crate) fn cat_case(
    c: &mut Ctx,
    w: usize,
    (outer, len0, len1, inner): (usize, usize, usize, usize),
) {
    let dtype = format!("{}-byte", w);
    let sh = format!("[{outer}, {len0}+{len1}, {inner}]");
    c.guard("layout.cat", &dtype, &sh, |c| {
        let d = c.d;
        let a = c.rng.words(outer * len0 * inner, w);
        let b = c.rng.words(outer * len1 * inner, w);
        let total = len0 + len1;
        let mut want = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            want.extend_from_slice(&a[o * len0 * inner..(o + 1) * len0 * inner]);
            want.extend_from_slice(&b[o * len1 * inner..(o + 1) * len1 * inner]);
        }
        let (ba, bb) = (d.bytes(&encode_words(w, &a))?, d.bytes(&encode_words(w, &b))?);
        let bo = d.junk(want.len() * w)?;
        // SAFETY: each piece holds `outer * len * inner` elements, the output the sum.
        unsafe {
            layout::cat(d.l(), w, &[(ba.ptr(), len0), (bb.ptr(), len1)], outer, inner, bo.ptr())?
        };
        c.r.exact("layout.cat", &dtype, &sh, &decode_words(w, &bo.to_host()?), &want);
        Ok(())
    });
}

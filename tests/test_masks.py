

def test_mask_gallery_draws_each_mask_beside_its_timings(tmp_path):
    from attnbench.report.mask_gallery import gallery
    from attnbench.results.schema import empty_row

    rows = [run_cell(Cell("mask_math", seq_len=16, d_model=16, num_heads=2, mode="inference", mask=m),
                     Settings(budget_s=0.02, accuracy="off")) for m in ("", "alibi")]
    rows.append(dict(empty_row(Cell("sdpa", seq_len=16, d_model=16, num_heads=2, mode="inference", mask="alibi")),
                     status="skipped"))
    df = pd.DataFrame(rows)
    (figure,) = gallery(df, tmp_path)
    assert figure.png.exists() and figure.name == "mask-gallery" and "skipped" in figure.caption
    assert gallery(df[df["mask"] == ""].iloc[:1], tmp_path) == []  # one plain causal mask: nothing to show

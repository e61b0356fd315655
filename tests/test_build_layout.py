"""Source-tree checks that need no compiler: generated files are current and named by what they hold."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GEMM = ROOT / "csrc" / "gemm"
# (dispatch header, shipped table, folder of its instantiation files, file prefix)
SHIPPED_TABLES = [
    ("sm90/scaled_mm_sm90_dispatch.cuh", "Int8Configs", "sm90", "int8"),
    ("sm90/scaled_mm_sm90_dispatch.cuh", "Fp8Configs", "sm90", "fp8"),
    ("sm90/scaled_mm_sm90_dispatch.cuh", "Fp8BlockConfigs", "sm90", "fp8block"),
    ("sm80/scaled_mm_sm80_dispatch.cuh", "Int8Configs", "sm80", "int8"),
    ("sm80/scaled_mm_sm80_dispatch.cuh", "Fp8Configs", "sm89", "fp8"),
]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen", GEMM / "generate_instantiations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def instantiation_files() -> dict:
    """{path relative to csrc/gemm/: text} of the instantiation files on disk."""
    return {str(p.relative_to(GEMM)): p.read_text() for p in GEMM.glob("sm*/instantiations*/*.cu")}


def table_items(header: str, table: str) -> list:
    """The items of `using <table> = std::tuple<...>;` in a header, comments dropped (independent of the generator)."""
    code = " ".join(line.split("//")[0] for line in (GEMM / header).read_text().splitlines())
    body = re.search(rf"using {table} = std::tuple<(.*?)>\s*;", code)
    assert body, f"{header} has no std::tuple named {table}"
    return [item.strip() for item in re.split(r",(?![^<]*>)", body.group(1))]


def test_instantiations_are_current():
    """Every (config, output) of the dispatch tables has its file, with the generated text."""
    expected = load_generator().expected_files()
    on_disk = instantiation_files()
    assert set(on_disk) == set(expected), "rerun: python csrc/gemm/generate_instantiations.py"
    for name, text in expected.items():
        assert on_disk[name] == text, f"{name} is stale: rerun the generator"


def test_no_instantiation_file_is_named_by_table_index():
    """A file name holds no bare number (`int8_bf16_3.cu`, `tune3`): inserting a row must rename nothing else."""
    for rel, text in instantiation_files().items():
        parts = pathlib.Path(rel).stem.split("_")
        assert not any(re.fullmatch(r"(tune)?\d+", part) for part in parts), rel
        assert "tuple_element" not in text, f"{rel} instantiates a config by table index"


@pytest.mark.parametrize("header,table,folder,prefix", SHIPPED_TABLES)
def test_every_shipped_config_is_a_named_bucket_with_its_files(header, table, folder, prefix):
    """Shipped tables list aliases named by bucket (`Int8_M32`); each has one file per output type instantiating it."""
    items = table_items(header, table)
    assert len(items) >= 2
    assert len(set(items)) == len(items), f"{table} lists a config twice"
    on_disk = instantiation_files()
    for alias in items:
        op, _, bucket = alias.partition("_")
        assert op.lower() == prefix and re.fullmatch(r"M\w+", bucket), f"{table}: {alias} is not <Op>_M<bucket>"
        for out in ("bf16", "f16"):
            rel = f"{folder}/instantiations/{prefix}_{bucket}_{out}.cu"
            assert rel in on_disk, f"{alias} has no {rel}: rerun the generator"
            # run_scaled_mm<...> (row-wise scales) or run_scaled_mm_block<...> (block-scaled fp8)
            assert re.search(rf"run_scaled_mm(_block)?<[^;]*, {alias}>\(", on_disk[rel]), \
                f"{rel} does not instantiate {alias}"


def setup_tune_tables() -> dict:
    """setup.py's TUNE_TABLES literal ({table: (file prefix, macro)}), read without running setup.py."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TUNE_TABLES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no TUNE_TABLES")


def test_tune_tables_select_their_candidates_only():
    """CUTLASS_W8A8_TUNE=<tables>: each table's glob under instantiations_tune/ matches exactly the files of its
    candidates, its macro is the one guarding its candidates in shipped files, and every candidate config is
    instantiated once, in a file that table's build compiles."""
    gen = load_generator()
    tune_tables = setup_tune_tables()
    assert set(tune_tables) == {"int8", "fp8", "fp8-block", "grouped"}
    by_prefix = {"Int8": "int8", "Fp8": "fp8", "Fp8Block": "fp8-block"}
    assert {by_prefix[k]: v for k, v in gen.TUNE_MACROS.items()} == \
        {t: m for t, (_, m) in tune_tables.items() if t != "grouped"}
    assert tune_tables["grouped"][1] == gen.GROUPED_TUNE_MACRO
    tune_files = {p.name: p.read_text() for p in (GEMM / "sm90" / "instantiations_tune").glob("*.cu")}
    shipped_files = {p.name: p.read_text() for p in (GEMM / "sm90" / "instantiations").glob("*.cu")}
    claimed = set()
    for prefix, table in by_prefix.items():
        file_prefix, macro = tune_tables[table]
        mine = {name for name in tune_files if name.startswith(file_prefix)}
        assert not mine & claimed, f"{table}'s glob {file_prefix}*.cu also matches another table's files"
        claimed |= mine
        # the candidates' instantiations a build of this table compiles: its tune files, and its #ifdef blocks
        texts = [tune_files[n] for n in mine]
        for name, text in shipped_files.items():
            for block in re.findall(rf"#ifdef {macro}\n(.*?)#endif", text, re.S):
                texts.append(block)
            assert not re.search(r"#ifdef CUTLASS_W8A8_TUNE\b(?!_)", text), name
        code = "\n".join(texts)
        for config in table_items("sm90/scaled_mm_sm90_dispatch.cuh", f"{prefix}TuneCandidates"):
            if not config:
                continue
            hits = re.findall(rf"template int run_scaled_mm(?:_block)?<[^;]*, {re.escape(config)}>\(", code)
            assert len(hits) == 1, f"{table}: {config} is instantiated {len(hits)} times in its tuning build's files"
    # the grouped GEMM's candidates (grouped/grouped_sm90_config.cuh): instantiations_tune/grouped_*.cu, one each
    file_prefix = tune_tables["grouped"][0]
    mine = {name for name in tune_files if name.startswith(file_prefix)}
    assert mine and not mine & claimed, f"grouped's glob {file_prefix}*.cu also matches another table's files"
    claimed |= mine
    code = "\n".join(tune_files[n] for n in mine)
    for table, ab, block in (("GInt8TuneCandidates", "int8_t", "false"),
                             ("GFp8TuneCandidates", "cutlass::float_e4m3_t", "false"),
                             ("GFp8BlockTuneCandidates", "cutlass::float_e4m3_t", "true")):
        configs = table_items("sm90/grouped/grouped_sm90_config.cuh", table)
        assert configs and all(configs), f"{table} lists no candidate"
        for config in configs:
            hits = re.findall(rf"template int run_grouped_mm<{re.escape(ab)}, cutlass::bfloat16_t, "
                              rf"{re.escape(config)}, {block}>\(", code)
            assert len(hits) == 1, f"{table}: {config} is instantiated {len(hits)} times in grouped's tuning files"
    assert claimed == set(tune_files), f"files no table builds: {set(tune_files) - claimed}"


GROUPED_FAMILIES = {"GInt8": ("int8", "int8_t", "false", "GInt8TuneCandidates"),
                    "GFp8": ("fp8", "cutlass::float_e4m3_t", "false", "GFp8TuneCandidates"),
                    "GFp8Block": ("fp8block", "cutlass::float_e4m3_t", "true", "GFp8BlockTuneCandidates")}
GROUPED_BUCKETS = ("Small", "Mid", "Large")  # the shipped entries' order (kNumGroupedConfigs, select_grouped)


def test_grouped_shipped_buckets_have_their_files():
    """Each family's shipped grouped entries (G<family>_Small / _Mid / _Large of grouped_sm90_config.cuh, in that order
    in visit_grouped_table) are instantiated once per output type, in grouped/grouped_<family>_<bucket>_<out>.cu; an
    alias of another bucket (as int8's Mid was its Large until 2026-11-30) has no file of its own (no second instantiation), and no tuning
    candidate repeats a shipped config of its table (it would be instantiated twice)."""
    header = GEMM / "sm90" / "grouped" / "grouped_sm90_config.cuh"
    code = " ".join(line.split("//")[0] for line in header.read_text().splitlines())
    aliases = dict(re.findall(r"using (G\w+?_(?:Small|Mid|Large)) = ([^;]+);", code))
    files = {p.name: p.read_text() for p in (GEMM / "sm90" / "grouped").glob("grouped_*_*_*.cu")}
    expected = set()
    visit = re.sub(r"\s+", " ", code.split("int visit_grouped_table", 1)[1].split("default:", 1)[0])
    for family, (stem, ab, block, candidates) in GROUPED_FAMILIES.items():
        names = [f"{family}_{b}" for b in GROUPED_BUCKETS]
        assert all(n in aliases for n in names), f"{family}: {names} not all defined: {sorted(aliases)}"
        assert f"{ab}, {block}, {', '.join(names)}, {candidates}>" in visit, f"{family}'s table in visit_grouped_table"
        shipped = set()
        for bucket, name in zip(GROUPED_BUCKETS, names):
            target = aliases[name].strip()
            if target in aliases:  # an alias of another bucket: that bucket's files serve it
                assert target in names and not aliases[target].strip() in aliases, f"{name} = {target}"
                continue
            shipped.add(re.sub(r"\s+", " ", target))
            for out, out_type in (("bf16", "cutlass::bfloat16_t"), ("f16", "cutlass::half_t")):
                rel = f"grouped_{stem}_{bucket}_{out}.cu"
                expected.add(rel)
                assert rel in files, f"{name} has no grouped/{rel}"
                assert re.search(rf"template int run_grouped_mm<{re.escape(ab)}, {re.escape(out_type)}, {name}, "
                                 rf"{block}>\(", files[rel]), f"grouped/{rel} does not instantiate {name}"
        tune = {re.sub(r"\s+", " ", c) for c in table_items("sm90/grouped/grouped_sm90_config.cuh", candidates) if c}
        assert not tune & shipped, f"{candidates} repeats shipped configs: {tune & shipped}"
    assert set(files) == expected, f"grouped/ files no shipped bucket explains: {set(files) - expected}"


def test_grouped_candidates_named_like_the_dense_ones():
    """A grouped candidate's file is the dense candidate name of its kernel after `grouped_` (the grouped header's
    GPP / GCO / GPE read as PP / CO / PE); the wave mainloop ones end in `_waves`, never with fast accumulation, TileK
    128; a scheduler swizzle (no grouped kernel takes one) is refused."""
    gen = load_generator()
    waves = "Config<256, 128, 128, 1, 1, GCO, GPE, false, false, 1, true>"
    assert gen.candidate_name("grouped_fp8block", waves) == "grouped_fp8block_tile256x128x128_cluster1x1_co_waves"
    assert gen.candidate_name("grouped_fp8", "Config<128, 128, 128, 1, 1, GCO, GPE, false>") == \
        "grouped_fp8_tile128x128x128_cluster1x1_co"
    assert gen.candidate_name("grouped_int8", "Config<64, 128, 128, 1, 1, GPP, GPE, false>") == \
        "grouped_int8_tile64x128x128_cluster1x1_pp"
    files = gen.grouped_tune_files()
    assert set(files) == {f"sm90/instantiations_tune/{n}" for n in
                          (# int8's and block fp8's former *_Large (the 128x128 tile), kept for the next A/B; the
                           # int8 64x128 / 128x256 and block 128x256 N-wave tiles once listed are shipped (2026-11-30)
                           "grouped_int8_tile128x128x128_cluster1x1_co_bf16.cu",
                           "grouped_fp8block_tile128x128x128_cluster1x1_co_bf16.cu",
                           "grouped_fp8_tile128x128x128_cluster1x1_co_bf16.cu",
                           "grouped_fp8_tile256x128x128_cluster1x1_co_waves_bf16.cu",
                           "grouped_fp8_tile256x128x128_cluster2x1_co_waves_bf16.cu",
                           "grouped_fp8_tile128x256x128_cluster1x1_co_waves_n128_bf16.cu",
                           "grouped_fp8block_tile256x128x128_cluster1x1_co_waves_bf16.cu",
                           "grouped_fp8block_tile256x128x128_cluster2x1_co_waves_bf16.cu",
                           # 2026-11-30: swapped 64-token pingpong tiles, 2x1 clusters, fp8's former *_Large (the
                           # 64x128 pingpong and fp8's 128x256 tiles of that list are now shipped: *_Mid, *_Large)
                           "grouped_fp8_tile128x64x128_cluster1x1_pp_swap_fastaccum_bf16.cu",
                           "grouped_fp8_tile128x128x128_cluster2x1_co_fastaccum_bf16.cu",
                           "grouped_fp8_tile128x128x128_cluster1x1_co_fastaccum_bf16.cu",
                           "grouped_fp8block_tile128x64x128_cluster1x1_pp_swap_bf16.cu",
                           "grouped_fp8block_tile128x128x128_cluster2x1_co_bf16.cu",
                           # row-wise fp8's *_Small / *_Mid tiles with promotion: an accurate table to time
                           "grouped_fp8_tile64x32x256_cluster1x1_pp_swap_bf16.cu",
                           "grouped_fp8_tile64x128x128_cluster1x1_pp_bf16.cu")}
    for table in ("GInt8TuneCandidates", "GFp8TuneCandidates", "GFp8BlockTuneCandidates"):
        for config in table_items("sm90/grouped/grouped_sm90_config.cuh", table):
            args = gen.config_args(config)
            assert args[9] == "1" and (args[10] == "false" or (args[2] == "128" and args[8] == "false")), config
            # the blockwise mainloop always promotes (scaled_mm_sm90_gemm.cuh refuses fast accumulation with it);
            # int8 has neither fast accumulation nor the wave mainloop (both fp8 only: scaled_mm_sm90_config.cuh)
            assert table != "GFp8BlockTuneCandidates" or args[8] == "false", config
            assert table != "GInt8TuneCandidates" or (args[8], args[10]) == ("false", "false"), config


WAVES = "Config<256, 128, 128, 2, 1, CO, PE, false, false, 1, true>"
WAVES_N = "Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, true, 128>"


@pytest.mark.parametrize("arg,with_flag,without,names", [
    (10, WAVES, "Config<256, 128, 128, 2, 1, CO, PE, false>",
     ("fp8block_tile256x128x128_cluster2x1_co_waves", "fp8block_tile256x128x128_cluster2x1_co")),
    (11, WAVES_N, "Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, true>",
     ("fp8block_tile128x256x128_cluster1x2_co_waves_n128", "fp8block_tile128x256x128_cluster1x2_co_waves")),
], ids=["waves", "wave_n"])
def test_wave_arguments_name_their_kernels(arg, with_flag, without, names):
    """A Config's 11th argument (the wave mainloop; default false) and 12th (WaveN, its waves along N; default 0, the
    tile's N) are part of the kernel: each names its own file (`_waves`, `_waves_n<W>`) and kernel key, never folded
    into the file of the same tile without it."""
    gen = load_generator()
    assert gen.config_args(with_flag)[arg] == with_flag[:-1].split(",")[arg].strip()
    assert gen.config_args(without)[arg] in ("false", "0")
    assert (gen.candidate_name("fp8block", with_flag), gen.candidate_name("fp8block", without)) == names
    assert gen.kernel_key(with_flag) != gen.kernel_key(without)


def test_wave_candidates_share_swizzles_and_stay_in_fp8_tables():
    """The wave mainloop's swizzle variants share its kernel; a bad flag is refused; it appears only in the fp8
    tables, never with fast accumulation, and with TileK 128 (GemmTypes' static_assert and the mainloop's)."""
    gen = load_generator()
    assert gen.kernel_key(WAVES) == gen.kernel_key("Config<256, 128, 128, 2, 1, CO, PE, false, false, 8, true>")
    with pytest.raises(SystemExit):
        gen.candidate_name("fp8", "Config<256, 128, 128, 2, 1, CO, PE, false, false, 1, maybe>")
    found = {}
    for table in ("Int8TuneCandidates", "Fp8TuneCandidates", "Fp8BlockTuneCandidates"):
        for config in table_items("sm90/scaled_mm_sm90_dispatch.cuh", table):
            args = gen.config_args(config)
            if args[10] == "true":
                found.setdefault(table, []).append(config)
                assert args[2] == "128" and args[8] == "false", f"{table}: {config}"
    assert set(found) == {"Fp8TuneCandidates", "Fp8BlockTuneCandidates"}, found


def test_wave_n_needs_the_wave_mainloop():
    """WaveN is refused without the wave mainloop or as a non-number; the shipped aliases with it are in the fp8
    tables only, with the wave mainloop (Config's static_assert)."""
    gen = load_generator()
    for bad in ("Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, false, 128>",
                "Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, true, n128>"):
        with pytest.raises(SystemExit):
            gen.candidate_name("fp8block", bad)
    aliases, _ = gen.parse_header(GEMM / "sm90/scaled_mm_sm90_dispatch.cuh")
    with_n = {name: c for name, c in aliases.items() if gen.config_args(c)[11] != "0"}
    assert with_n and all(name.startswith("Fp8") and gen.config_args(c)[10] == "true" for name, c in with_n.items())


def test_dispatch_returns_named_indices():
    """select_* return index_of<Alias, Table>, never a bare table index."""
    for header in ("sm90/scaled_mm_sm90_dispatch.cuh", "sm80/scaled_mm_sm80_dispatch.cuh"):
        code = (GEMM / header).read_text()
        returns = re.findall(r"return ([^;]*);", code.split("inline int select", 1)[1])
        assert returns and not any(re.search(r"(^|[ ?:])\d+\s*($|:)", r) for r in returns), header


def test_package_imports_without_extension():
    import cutlass_w8a8

    status = cutlass_w8a8.extension_status()
    assert "_C:" in status and "_kernels_sm90:" in status

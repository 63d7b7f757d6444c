# kiln's Python kernel driver. It runs inside the sandbox, started by
# kiln-agent. Requests arrive as JSON lines on fd 3; each answer is one JSON
# line on fd 4, naming the cell it answers. The cell's stdout and stderr are
# the process's own fds 1 and 2, read by the agent, which marks where a
# cell's output starts and ends itself: this process is the cell's, so
# nothing it knows could mark that unforgeably.
import ast
import base64
import builtins
import json
import linecache
import os
import sys
import traceback

_REQ = None  # fd 3, opened by serve()
_RES = None  # fd 4
_MAX_REPR = 8 << 20  # one representation; bigger ones are dropped with a note
_MAX_DISPLAYS = 64
_MAX_RICH = 4 << 20  # all representations of one cell together (agentproto.MaxRich)
_DRIVER_FILE = "<kiln-driver>"

_displays = []
_cell_count = 0
_rich_used = 0  # bytes of representations kept in this cell

_TEXT_REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
]
_BINARY_REPRS = [
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
]


def _is_figure(obj):
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _figure_png(fig):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _put(bundle, mime, value):
    if value is None:
        return
    if isinstance(value, tuple):  # (data, metadata)
        value = value[0]
    if isinstance(value, (bytes, bytearray)):
        value = base64.b64encode(bytes(value)).decode("ascii")
    elif mime == "application/json" and not isinstance(value, str):
        value = json.dumps(value, default=str)
    elif not isinstance(value, str):
        value = str(value)
    global _rich_used
    size = len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
    if len(value) > _MAX_REPR:
        bundle.setdefault("text/x-kiln-note", "")
        bundle["text/x-kiln-note"] += "%s representation dropped: %d bytes is over the cap\n" % (mime, len(value))
        return
    if _rich_used + size > _MAX_RICH:
        bundle.setdefault("text/x-kiln-note", "")
        bundle["text/x-kiln-note"] += "%s representation dropped: %d bytes would take the rich output of this call over %d MiB\n" % (mime, size, _MAX_RICH >> 20)
        return
    _rich_used += size
    bundle[mime] = value


def mimebundle(obj):
    """The display representations of obj, as Jupyter computes them."""
    bundle = {}
    if _is_figure(obj):
        _put(bundle, "image/png", _figure_png(obj))
        try:
            import matplotlib.pyplot as plt

            plt.close(obj)
        except Exception:
            pass
        bundle["text/plain"] = repr(obj)
        return bundle
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(obj, type):
        try:
            data = method()
            if isinstance(data, tuple):
                data = data[0]
            for mime, value in (data or {}).items():
                _put(bundle, mime, value)
        except Exception:
            pass
    if not isinstance(obj, type):
        for mime, name in _BINARY_REPRS + _TEXT_REPRS:
            if mime in bundle:
                continue
            method = getattr(obj, name, None)
            if callable(method):
                try:
                    _put(bundle, mime, method())
                except Exception:
                    pass
    if "text/plain" not in bundle:
        try:
            _put(bundle, "text/plain", repr(obj))
        except Exception as e:
            bundle["text/plain"] = "<repr failed: %s: %s>" % (type(e).__name__, e)
    return bundle


def display(*objs, **kwargs):
    """Show objects in the tool result, like IPython's display()."""
    for obj in objs:
        if len(_displays) >= _MAX_DISPLAYS:
            return
        if kwargs.get("raw") and isinstance(obj, dict):
            bundle = {}
            for mime, value in obj.items():
                _put(bundle, mime, value)
        else:
            bundle = mimebundle(obj)
        _displays.append(bundle)


class _Image:
    """IPython.display.Image's small cousin: display(Image(filename=…))."""

    def __init__(self, data=None, filename=None, format="png"):
        if filename is not None:
            with open(filename, "rb") as f:
                data = f.read()
            if filename.lower().endswith((".jpg", ".jpeg")):
                format = "jpeg"
        self.data, self.format = data, format

    def _repr_mimebundle_(self):
        return {"image/" + self.format: self.data, "text/plain": "<Image %s, %d bytes>" % (self.format, len(self.data or b""))}


class _HTML:
    def __init__(self, data):
        self.data = data

    def _repr_html_(self):
        return self.data

    def __repr__(self):
        return "<HTML>"


class _Markdown:
    def __init__(self, data):
        self.data = data

    def _repr_markdown_(self):
        return self.data

    def __repr__(self):
        return self.data


def _capture_figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if len(_displays) < _MAX_DISPLAYS:
            try:
                _displays.append({"image/png": _figure_png(fig), "text/plain": repr(fig)})
            except Exception as e:
                _displays.append({"text/plain": "<figure could not be rendered: %s>" % e})
        plt.close(fig)


def _show(*args, **kwargs):
    _capture_figures()


def _setup_matplotlib():
    # matplotlib takes its backend from MPLBACKEND when it is imported, so
    # a kernel that does not preload it leaves the import (0.1-0.5 s) to
    # the first cell that needs it; one that preloads it imports it with
    # Agg already chosen.
    os.environ["MPLBACKEND"] = "Agg"


def _patch_pyplot():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None and plt.show is not _show:
        plt.show = _show


def _user_frames(tb):
    # Drop the driver's own frames so the traceback starts in the cell.
    while tb is not None and tb.tb_frame.f_code.co_filename in (_DRIVER_FILE, "<string>"):
        tb = tb.tb_next
    return tb


def _format_error(e):
    if isinstance(e, SyntaxError):
        lines = traceback.format_exception_only(type(e), e)
    else:
        lines = traceback.format_exception(type(e), e, _user_frames(e.__traceback__))
    return {"ename": type(e).__name__, "evalue": str(e), "traceback": "".join(lines)}


def _run_cell(code, ns):
    global _cell_count
    _cell_count += 1
    filename = "<cell %d>" % _cell_count
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    result, error, interrupted = None, None, False
    try:
        tree = ast.parse(code, filename=filename, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        _patch_pyplot()
        if last is not None:
            value = eval(compile(last, filename, "eval"), ns)
            _patch_pyplot()
            if value is not None:
                ns["_"] = value
                result = mimebundle(value)
    except KeyboardInterrupt as e:
        interrupted = True
        error = _format_error(e)
    except SystemExit as e:
        error = {"ename": "SystemExit", "evalue": str(e.code), "traceback": "SystemExit: %s\n" % (e.code,)}
    except BaseException as e:
        error = _format_error(e)
    try:
        _capture_figures()
    except KeyboardInterrupt:
        interrupted = True
    return result, error, interrupted


# State-level snapshots. The agent asks for them with a "state" request
# ({"op": "save"|"load", "path": archive, "workspace": dir}); the answer
# is {"cell", "state": {"saved", "dropped"}} or {"cell", "state_error"}.
# The archive is a tar made and read here, in the box: globals.json (the
# order of the pickles, the modules to re-import), globals/N (one global,
# pickled alone with dill, so one that cannot be pickled costs only
# itself) and workspace/... (the workspace's directories and regular
# files). The host moves its bytes and never decodes them.
_MAX_STATE_NAMES = 2048  # agentproto.MaxStateNames
_MAX_STATE_ENTRY = 500  # under agentproto.MaxStateEntry


def _state_entry(s):
    s = s.replace("\n", " ")
    if len(s.encode("utf-8", "replace")) > _MAX_STATE_ENTRY:
        s = s.encode("utf-8", "replace")[: _MAX_STATE_ENTRY - 4].decode("utf-8", "ignore") + " …"
    return s


def _state_list(entries):
    entries = [_state_entry(e) for e in entries]
    if len(entries) > _MAX_STATE_NAMES:
        more = len(entries) - (_MAX_STATE_NAMES - 1)
        entries = entries[: _MAX_STATE_NAMES - 1] + ["… and %d more" % more]
    return entries


def _state_skip(name, value):
    # What the driver itself installs (and installs again in every box),
    # and Python's own module attributes.
    if name.startswith("__") and name.endswith("__"):
        return True
    if name in ("_", "__", "___"):
        return True
    return any(value is x for x in (display, _Image, _HTML, _Markdown))


def _state_save(path, workspace):
    import io
    import stat
    import tarfile
    import types

    import dill

    ns = sys.modules["__main__"].__dict__
    saved, dropped, order, modules = [], [], [], {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))

        for name, value in list(ns.items()):
            if _state_skip(name, value):
                continue
            if isinstance(value, types.ModuleType):
                modules[name] = value.__name__
                saved.append(name)
                continue
            if isinstance(value, io.IOBase) and not isinstance(value, (io.BytesIO, io.StringIO)):
                dropped.append("%s: open file handles are not saved (reopen the file after a restore)" % name)
                continue
            try:
                data = dill.dumps(value, recurse=True)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - anything a __reduce__ raises
                dropped.append("%s: %s" % (name, str(e) or type(e).__name__))
                continue
            add("globals/%d" % len(order), data)
            order.append(name)
            saved.append(name)
        add("globals.json", json.dumps({"order": order, "modules": modules}).encode())
        for root, dirs, files in os.walk(workspace):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, workspace)
                try:
                    st = os.lstat(full)
                except OSError as e:
                    dropped.append("file %s: %s" % (rel, e.strerror))
                    continue
                if stat.S_ISLNK(st.st_mode):
                    dropped.append("file %s: symbolic links are not saved" % rel)
                    continue
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    dropped.append("file %s: only regular files and directories are saved" % rel)
                    continue
                try:
                    tar.add(full, arcname="workspace/" + rel, recursive=False)
                except OSError as e:
                    if e.errno == 28:  # ENOSPC: the archive itself
                        raise
                    dropped.append("file %s: %s" % (rel, e.strerror))
                except Exception as e:  # noqa: BLE001 - a name tar cannot encode
                    dropped.append("file %s: %s" % (rel, e))
    return {"saved": _state_list(saved), "dropped": _state_list(dropped)}


def _state_member(name):
    """The workspace-relative path of a workspace/ member, or None."""
    if not name.startswith("workspace/") or "\0" in name:
        return None
    rel = os.path.normpath(name[len("workspace/"):])
    if rel in (".", "") or rel.startswith("/") or rel == ".." or rel.startswith("../"):
        return None
    return rel


def _state_load(path, workspace):
    import importlib
    import tarfile

    import dill

    ns = sys.modules["__main__"].__dict__
    loaded, dropped = [], []
    with tarfile.open(path, mode="r:") as tar:
        members = tar.getmembers()
        meta, pickles = {"order": [], "modules": {}}, {}
        for m in members:
            if m.name == "globals.json" and m.isreg():
                meta = json.loads(tar.extractfile(m).read())
            elif m.name.startswith("globals/") and m.isreg():
                pickles[m.name] = m
        for m in members:
            rel = _state_member(m.name)
            if rel is None:
                continue
            dst = os.path.join(workspace, rel)
            try:
                if m.isdir():
                    os.makedirs(dst, exist_ok=True)
                elif m.isreg():
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, (m.mode & 0o755) | 0o600)
                    with os.fdopen(fd, "wb") as out, tar.extractfile(m) as src:
                        while True:
                            chunk = src.read(1 << 20)
                            if not chunk:
                                break
                            out.write(chunk)
                    os.utime(dst, (m.mtime, m.mtime))
            except Exception as e:  # noqa: BLE001
                dropped.append("file %s: %s" % (rel, getattr(e, "strerror", None) or e))
        for name, module in dict(meta.get("modules", {})).items():
            try:
                ns[str(name)] = importlib.import_module(str(module))
                loaded.append(str(name))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001
                dropped.append("%s: cannot import module %s: %s" % (name, module, e))
        for i, name in enumerate(list(meta.get("order", []))):
            m = pickles.get("globals/%d" % i)
            if m is None:
                dropped.append("%s: missing from the snapshot" % name)
                continue
            try:
                ns[str(name)] = dill.loads(tar.extractfile(m).read())
                loaded.append(str(name))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001
                dropped.append("%s: %s" % (name, str(e) or type(e).__name__))
    try:
        os.unlink(path)
    except OSError:
        pass
    return {"saved": _state_list(loaded), "dropped": _state_list(dropped)}


def _state(req):
    op, path, workspace = req.get("op"), str(req.get("path", "")), str(req.get("workspace", ""))
    try:
        if op == "save":
            return {"state": _state_save(path, workspace)}
        if op == "load":
            return {"state": _state_load(path, workspace)}
        return {"state_error": "unknown state operation"}
    except ImportError as e:
        return {"state_error": "cannot %s the kernel's state: %s (python3-dill is needed in the sandbox's runtime)" % (op, e)}
    except OSError as e:
        if e.errno == 28:  # ENOSPC
            return {"state_error": "cannot %s the session's state: the sandbox's /tmp, where it is packed, has no room for it; delete large files or variables first" % op}
        return {"state_error": "cannot %s the kernel's state: %s: %s" % (op, type(e).__name__, e)}
    except BaseException as e:  # noqa: BLE001
        return {"state_error": "cannot %s the kernel's state: %s: %s" % (op, type(e).__name__, e)}


def _send(obj):
    _RES.write((json.dumps(obj) + "\n").encode())


def prepare():
    """Import the preloaded modules and install display(); returns their names."""
    _setup_matplotlib()
    preloaded = []
    for name in [m for m in os.environ.pop("KILN_PRELOAD", "").split(",") if m]:
        try:
            __import__(name)
            preloaded.append(name)
        except Exception:
            pass
    if "matplotlib" in preloaded:
        try:
            import matplotlib.pyplot  # noqa: F401

            _patch_pyplot()
        except Exception:
            pass
    builtins.display = display
    # The cell namespace is __main__'s, so classes defined in cells pickle.
    ns = sys.modules["__main__"].__dict__
    ns.update({"display": display, "Image": _Image, "HTML": _HTML, "Markdown": _Markdown})
    return preloaded


def serve(preloaded):
    """Say ready on fd 4, then run the cells that arrive on fd 3 until EOF."""
    global _REQ, _RES, _rich_used
    # Children the cells start (os.system, a shell) get neither.
    os.set_inheritable(3, False)
    os.set_inheritable(4, False)
    _REQ = os.fdopen(3, "rb", buffering=0)
    _RES = os.fdopen(4, "wb", buffering=0)
    ns = sys.modules["__main__"].__dict__
    _send({"ready": True, "python": sys.version.split()[0], "preloaded": preloaded})
    buf = b""
    while True:
        try:
            chunk = _REQ.read(1 << 16)
        except KeyboardInterrupt:
            continue
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                if "state" in req:
                    cell = req["cell"]
                    answer = {}
                    try:
                        answer = _state(req["state"])
                    except KeyboardInterrupt:
                        answer = {"state_error": "interrupted"}
                    answer["cell"] = cell
                    _send(answer)
                    continue
                code, cell = req["code"], req["cell"]
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            _displays.clear()
            _rich_used = 0
            result, error, interrupted = None, None, False
            try:
                result, error, interrupted = _run_cell(code, ns)
            except KeyboardInterrupt:
                interrupted = True
            displays = list(_displays)
            _displays.clear()
            # The cell's output is in the pipes before the answer is.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            _send({"cell": cell, "result": result, "displays": displays, "error": error, "interrupted": interrupted})


def main():
    serve(prepare())


# A jail zygote passes its fork server in KILN_ZYGOTE (zygote.py): it runs
# prepare() once and serve() in every box it forks.
_ZYGOTE = os.environ.pop("KILN_ZYGOTE", "")
if _ZYGOTE:
    exec(compile(_ZYGOTE, "<kiln-zygote>", "exec"), globals())
    del _ZYGOTE
    zygote_main()
else:
    del _ZYGOTE
    main()

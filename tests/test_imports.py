"""The project's imports form a tree with hetero_gpt.py at its root: plumbing/ (what it uses)
never imports it back, tools/ (what extends it) is never imported by it, no module imports
itself through others, and `python hetero_gpt.py` loads the file once. Read with ast, lazy
imports inside functions included."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
    if rel.startswith('tests.'):  # pytest puts tests/ (and the double's folder) on sys.path
        return rel.split('.')[-1]
    return rel.removesuffix('.__init__')


def project_modules():
    found = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(('.', '__', 'data', 'out'))]  # no venvs, caches, runs
        found |= {module_name(os.path.join(top, f)): os.path.join(top, f) for f in files if f.endswith('.py')}
    return found


def targets(node, name, modules):
    """The project modules an import statement in the module `name` names."""
    if isinstance(node, ast.Import):
        candidates = [a.name for a in node.names]
    else:
        base = node.module or ''
        if node.level:  # from . import x, from .x import y
            package = name.rsplit('.', node.level)[0] if '.' in name else ''
            base = '.'.join(filter(None, [package, node.module]))
        candidates = [f'{base}.{a.name}' for a in node.names] + [base]
    found = set()
    for c in candidates:
        while c and c not in modules:  # `import a.b.c`: the deepest project module named
            c = c.rpartition('.')[0]
        if c and c != name:
            found.add(c)
    return found


def imports(name, path, modules):
    """The project modules that the module `name` imports, anywhere in its file."""
    return {m for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, (ast.Import, ast.ImportFrom))
            for m in targets(node, name, modules)}


def graph():
    modules = project_modules()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def reachable(g, start):
    seen, todo = set(), list(g[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    return seen


def test_no_module_imports_itself_through_others():
    g = graph()
    cycles = sorted(m for m in g if m in reachable(g, m))
    assert not cycles, {m: sorted(g[m]) for m in cycles}


def test_hetero_gpt_is_the_root_of_what_it_uses():
    g = graph()
    used = reachable(g, 'hetero_gpt')
    # what it uses: the data file and the plumbing, nothing that extends it
    assert used == {'prepare_data'} | {m for m in g if m.startswith('plumbing')}, sorted(used)
    # the plumbing never imports it (nor anything that does)
    assert all('hetero_gpt' not in reachable(g, m) for m in used)
    # what extends it imports it
    for m in ('export_ane', 'bench', 'test_grads', 'tools.fast_standin', 'tools.ane_check', 'tools.compare'):
        assert m not in g or 'hetero_gpt' in g[m], m  # (the copy without the fast path lacks one)


def test_each_project_import_of_the_reference_says_what_it_brings():
    # llm.c's `#include "llmc/dataloader.h"  // defines: ...`: every import of a project module
    # in hetero_gpt.py carries a comment
    lines = open(os.path.join(ROOT, 'hetero_gpt.py')).read().split('\n')
    modules = project_modules()
    for node in ast.walk(ast.parse('\n'.join(lines))):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and targets(node, 'hetero_gpt', modules):
            line = lines[node.lineno - 1]
            assert '#' in line and len(line.split('#', 1)[1].split()) >= 2, line


def test_the_trainer_runs_its_file_once():
    # `python hetero_gpt.py` is __main__; nothing imports it again as hetero_gpt
    r = subprocess.run([sys.executable, '-X', 'importtime', 'hetero_gpt.py', '--help'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = [line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')]
    assert 'plumbing.settings' in loaded and 'hetero_gpt' not in loaded

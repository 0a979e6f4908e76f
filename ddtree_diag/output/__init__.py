"""Everything a finished RunReport becomes: terminal tables (``console``), Markdown and JUnit for
CI, the JSON report file (``reportfile``), and the comparison of two runs (``diff``). All cells
come from ``cells``, so a case reads the same in every format."""

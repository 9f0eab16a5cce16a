from kvrelay.cli import main

raise SystemExit(main())

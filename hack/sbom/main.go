// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

// Command sbom writes the SPDX document of an image's root file system
// (internal/sbom); hack/release.sh runs it on each architecture's image.
//
//	go run ./hack/sbom --root DIR --name REPO --version V --arch ARCH > FILE
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/mpnbd/mpnbd/internal/sbom"
)

func main() {
	var im sbom.Image
	root := flag.String("root", "", "the image's root file system (a mounted container)")
	flag.StringVar(&im.Name, "name", "", "the image's name without its tag")
	flag.StringVar(&im.Version, "version", "", "the image's tag, the driver's version")
	flag.StringVar(&im.Arch, "arch", "", "the image's architecture")
	flag.Parse()
	if *root == "" || im.Name == "" || im.Version == "" || im.Arch == "" {
		fmt.Fprintln(os.Stderr, "sbom: --root, --name, --version and --arch are required")
		os.Exit(2)
	}
	doc, err := sbom.Generate(*root, im)
	if err == nil {
		err = doc.Write(os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "sbom:", err)
		os.Exit(1)
	}
}
